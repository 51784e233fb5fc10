import os

import tests  # noqa: F401  the repository's folders on sys.path (tests/__init__.py)

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402  (after OMP_NUM_THREADS; torch does not import triton)
import pytest  # noqa: E402

# Without CUDA, Triton's kernels run on CPU tensors in its interpreter, and only where a test asks
# for it (the ``triton_interpreter`` fixture: the kernel tests, the fused groups, the fused loss).
# A kernel is the interpreter's if TRITON_INTERPRET=1 when ``triton.jit`` defines it, so fxmegatron's
# own kernels are defined here under it; whether one runs is read at each call
# (``codegen.where_kernels_run``), so the variable is then taken away again: every other test runs
# the torch form of each kernel, as a CPU user does. (In the interpreter FusedAdamW's step took 5 s
# for 200k parameters, and the suite's parity tests spent most of their time there.) The gloo
# workers' forkserver defines them alike (tests/distributed.py); with CUDA the kernels run compiled.
INTERPRETER = not torch.cuda.is_available()
if INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"
    import tests.worker_preload  # noqa: E402,F401  fxmegatron's modules, its kernels defined under it
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture
def triton_interpreter(monkeypatch):
    """The test runs Triton's kernels in the interpreter on CPU tensors (its gloo workers too)."""
    if INTERPRETER:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


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
