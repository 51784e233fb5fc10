import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton reads TRITON_INTERPRET when it is first imported (torch.export can import it), so the
# generated kernels of the fuse pass run on CPU only if it is set before anything else: here.
# Without CUDA, fused groups then run their kernels in the interpreter in every test; with
# CUDA the GPU tests run the compiled kernels (the interpreter would run them on host copies).
import torch  # noqa: E402  (after OMP_NUM_THREADS; torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
