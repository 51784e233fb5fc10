"""Calls run on a thread of fxmegatron's own, one per CUDA device, on the caller's stream.

Why: torch keeps cuDNN's attention graphs in a per-thread cache keyed by the shapes and strides
of q, k and v, while the backward graph also bakes in the strides of the grad-output and the
output (torch 2.11 with cuDNN 9.19: ``benchmarks/cudnn_sdpa_cache.py`` shows it). Autograd runs
every model's backward on one thread per device, so a model of someone else's in the process (a
``torch.compile``'d one, whose grad-output is laid out unlike its output) that ran first on the
same shapes leaves a graph that gives fxmegatron's call wrong gradients, silently. A thread only
fxmegatron's calls use has a cache of its own, filled only by calls laid out one way
(``attention_blocks._cudnn_backward``). docs/TRAINING.md, "Beside other models in one process".
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _worker(index: int) -> ThreadPoolExecutor:
    # one per device for the life of the process: its cache is the point
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fxmegatron-cuda{index}",
                              initializer=torch.cuda.set_device, initargs=(index,))


def on_own_thread(fn: Callable[[], T], device: torch.device) -> T:
    """``fn()`` run on fxmegatron's thread for ``device`` (a CUDA device), on the stream that is
    current here, so it is ordered with the caller's work as if called in place."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)

    def call():
        with torch.cuda.stream(stream):
            return fn()
    return _worker(index).submit(call).result()
