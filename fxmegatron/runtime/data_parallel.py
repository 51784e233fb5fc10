"""Data parallelism: gradients averaged over the "dp" group in buckets, overlapped with backward.

Each parameter's gradient is final after its last accumulation of the step (one per
microbatch and per chunk of this rank that uses it). A post-accumulate-grad hook
counts accumulations; when every parameter of a bucket is final, the bucket is
flattened and all-reduced asynchronously, while the backward of the last
microbatch goes on. ``finish`` launches what is left (parameters that got no
gradient), waits, and writes the averages back.

Why not ``DistributedDataParallel``: DDP wraps a module whose ``forward`` is the
whole step; a pipeline stage runs several chunk modules, microbatch by
microbatch, under a schedule, and DDP's reducer cannot be told when the last
accumulation of a parameter happens across chunks. The bucketing here is the
same idea as DDP's reducer, kept to what this runtime needs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


class GradSync:
    """Bucketed, overlapped gradient averaging for ``params`` over ``group``: the sum over the
    group divided by ``divisor`` (default ``world``). Under context parallelism the group is
    dp × cp and the divisor dp: each cp rank holds the gradient of its tokens' share of the
    loss, which add up, while dp replicas each hold a mean over their own batch."""

    def __init__(self, params: Sequence[nn.Parameter], uses: Dict[int, int], group, world: int,
                 bucket_mb: float = 25.0, divisor: Optional[int] = None):
        self.group, self.world = group, world
        self.divisor = world if divisor is None else divisor
        self.params = [p for p in params if p.requires_grad]
        self.uses = uses                      # id(param) -> accumulations per microbatch
        # backward visits parameters roughly in reverse: fill buckets from the end
        self.buckets: List[List[nn.Parameter]] = []
        cur, size = [], 0
        limit = bucket_mb * 2**20
        for p in reversed(self.params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self._expected: Dict[int, int] = {}
        self._count: Dict[int, int] = {}
        self._ready: List[int] = [0] * len(self.buckets)
        self._work: List[Optional[tuple]] = [None] * len(self.buckets)
        self.active = False
        self.launched_in_backward = 0     # buckets reduced while backward was still running (last step)

    def start(self, microbatches: int) -> None:
        """Arm for one step of ``microbatches``."""
        self._expected = {id(p): microbatches * self.uses.get(id(p), 1) for p in self.params}
        self._count = {id(p): 0 for p in self.params}
        self._ready = [0] * len(self.buckets)
        self._work = [None] * len(self.buckets)
        self.launched_in_backward = 0
        self.active = self.world > 1

    def _hook(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        k = id(p)
        self._count[k] += 1
        if self._count[k] == self._expected[k]:
            b = self.bucket_of[k]
            self._ready[b] += 1
            if self._ready[b] == len(self.buckets[b]):
                self._launch(b)
                self.launched_in_backward += 1

    def _launch(self, b: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[b]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._work[b] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self) -> None:
        """Launch the buckets still waiting, wait for all, write the averages into ``.grad``."""
        if not self.active:
            return
        for b in range(len(self.buckets)):
            if self._work[b] is None:
                self._launch(b)
        for b, (flat, work) in enumerate(self._work):
            work.wait()
            if self.divisor != 1:
                flat.div_(self.divisor)
            off = 0
            for p in self.buckets[b]:
                n = p.numel()
                g = flat[off:off + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += n
        self.active = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
