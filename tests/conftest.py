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

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_the_thread_count():
    """Each test ends with the thread count it started with. ``fxmegatron verify``'s CLI sets its
    own (a process entry point may), and a test calling it in-process once left 2 threads to the
    files after it on its worker: inductor's CPU kernels then scatter the embedding's gradient
    with atomic adds from two threads, whose order varies, and a bit-for-bit comparison of two
    compiled programs in a later file failed in one of three whole runs."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
