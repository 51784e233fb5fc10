"""Calls run on a thread of fxmegatron's own, one per CUDA device, on the caller's stream.

Why: torch keeps cuDNN's attention graphs in a per-thread cache keyed by the shapes and strides
of q, k and v, while the backward graph also bakes in the strides of the grad-output and the
output (torch 2.11 with cuDNN 9.19: ``benchmarks/cudnn_sdpa_cache.py`` shows it). Autograd runs
every model's backward on one thread per device, so a model of someone else's in the process (a
``torch.compile``'d one, whose grad-output is laid out unlike its output) that ran first on the
same shapes leaves a graph that gives fxmegatron's call wrong gradients, silently. A thread only
fxmegatron's calls use has a cache of its own, filled only by calls laid out one way
(``attention_blocks._cudnn_backward``). docs/TRAINING.md, "Beside other models in one process".

Under ``compile="reduce-overhead"`` (CUDA graphs) torch.compile's graph tree warms a graph up
eagerly with the caller's allocations routed, by thread, to the graphs' private pool; what the
worker allocates lands outside it. Inductor may give such a buffer, once dead, to a graph
output of the same size (attention's dq to an MLP weight's gradient in HF Llama-3.2-1B), and the
tree then refuses the step ("storage data ptrs are not allocated in pool"). So during a
warm-up the worker's results are copied on the caller's thread (``_in_graph_warmup``); while
the tree records, allocations follow the capturing stream and stay as they are, and a replay
runs no Python at all. (Routing the worker's allocations to the same pool instead, with
torch's begin/end-allocate-to-pool calls, ended in a segfault on an H200; not pursued: the
allocator ends a pool's routing by dropping the first routing it holds for that pool, which
would be the caller's.)
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch
import torch.utils._pytree as pytree

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _worker(index: int) -> ThreadPoolExecutor:
    # one per device for the life of the process: its cache is the point
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxmegatron-cuda{index}",
                              initializer=torch.cuda.set_device, initargs=(index,))


def _in_graph_warmup(index: int, stream) -> bool:
    """Whether the caller runs inside a warm-up of torch.compile's CUDA-graph tree on device
    ``index``: the tree's manager exists and its stream is current, not capturing. Reads
    inductor's internals without creating anything; False wherever they have moved."""
    try:
        from torch._inductor import cudagraph_trees
        containers = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
        manager = getattr(containers.get(index), "tree_manager", None)
    except Exception:       # another torch's internals: as without graphs
        return False
    return (manager is not None and getattr(manager, "stream", None) == stream
            and not torch.cuda.is_current_stream_capturing())


def on_own_thread(fn: Callable[[], T], device: torch.device) -> T:
    """``fn()`` run on fxmegatron's thread for ``device`` (a CUDA device), on the stream that is
    current here, so it is ordered with the caller's work as if called in place; in a CUDA-graph
    tree's warm-up its tensors are copied here (``_in_graph_warmup``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)

    def call():
        with torch.cuda.stream(stream):
            return fn()
    out = _worker(index).submit(call).result()
    if _in_graph_warmup(index, stream):     # copies made here, on the caller's thread
        return pytree.tree_map_only(torch.Tensor, torch.clone, out)
    return out
