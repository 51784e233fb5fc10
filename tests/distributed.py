"""Run a function on N gloo (or NCCL, one GPU each) processes and collect what each returns.

gloo workers fork from a forkserver that has already imported torch, transformers and
fxmegatron: each fresh process then starts in a fraction of a second instead of importing
them again (about 4 s of one core each, for hundreds of multi-process tests on a 2-core CI).
The forkserver is a clean process (it never ran a test), and each worker takes the parent's
environment as it is at the call, as a spawned one would. NCCL workers are spawned."""
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = ["tests.worker_preload"]


def _worker(rank, world, fn, args, tmp, backend="gloo", environ=None):
    if environ is not None:  # a forked worker: the parent's environment of now, not the server's
        os.environ.clear()
        os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # report to the parent, which re-raises
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(f"{tmp}/result{rank}.part", "wb") as f:
        pickle.dump(result, f)
    os.rename(f"{tmp}/result{rank}.part", f"{tmp}/result{rank}")
    # no process exits before every rank has its result: a rank that returns while a peer is still
    # connecting a group to it (DeviceMesh builds gloo pairs lazily) closes the socket under that
    # peer ("Connection closed by peer"). The rendezvous is on files, not on gloo, so a rank that
    # failed mid-collective still gets here; a rank that died is seen by join, which ends the rest.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not all(os.path.exists(f"{tmp}/result{r}") for r in range(world)):
        time.sleep(0.01)
    # no destroy_process_group: after a pipeline failure a receive may still be pending, and
    # tearing gloo down under it aborts; the process ends here either way
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_method(backend):
    if backend != "gloo":
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    if not torch.cuda.is_available():
        # the preload defines fxmegatron's Triton kernels: as the interpreter's, so that a test with
        # the triton_interpreter fixture runs them in its workers (conftest.py); the others don't
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
    return "forkserver"


def run_distributed(fn, world, *args, backend="gloo"):
    """``fn(rank, world, *args)`` on ``world`` processes (``backend`` "nccl": rank r on GPU r);
    returns the list of results."""
    method = _start_method(backend)
    environ = dict(os.environ) if method == "forkserver" else None
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, fn, args, tmp, backend, environ), nprocs=world,
                           join=True, start_method=method)
        results = []
        for r in range(world):
            with open(f"{tmp}/result{r}", "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(value)
            results.append(value)
    return results
