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

from typing import Callable, Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fxmegatron.errors import ReplicaError, ShardingError
from fxmegatron.lower.materialize import weight_digest
from fxmegatron.mesh import Axis
from fxmegatron.runtime.sharded_dp import (Done, adopt, all_gather, all_reduce, bucket_layout, reduce_scatter_bucket,
                                           segments)


class GradSync:
    """Bucketed, overlapped gradient averaging for ``params`` over ``group`` (a process group, or
    a simulated group's name under ``verify``): the sum over the
    group divided by ``divisor`` (default ``world``). Under context parallelism the group is
    dp × cp and the divisor dp: each cp rank holds the gradient of its tokens' share of the
    loss, which add up, while dp replicas each hold a mean over their own batch."""

    def __init__(self, params: Sequence[nn.Parameter], uses: Dict[int, int], group, world: int,
                 bucket_mb: float = 25.0, divisor: Optional[int] = None, shard: bool = False,
                 rank: int = 0, alone: Collection[int] = (), every_microbatch: bool = False,
                 sum_dtype: Optional[torch.dtype] = None, replicas=None):
        self.group, self.world, self.rank = group, world, rank
        # hybrid sharding: the group of the ranks holding the same pieces in the other replica
        # groups; each reduced piece is summed over it before the division
        self.replicas = replicas
        self.divisor = world if divisor is None else divisor
        # shard: each bucket reduce-scattered (``runtime.sharded_dp``): this rank keeps its piece in
        # ``pieces[b]`` and the full gradients are dropped once their bucket is launched
        self.shard = shard
        # every_microbatch (``dp_shard="gradients"``, ZeRO-2): a bucket is reduce-scattered each time
        # its parameters have all had another microbatch's accumulations, and the pieces are summed
        # here (in ``sum_dtype``, default the gradients'), so no whole gradient outlives its bucket's
        # launch; without it a bucket waits for the step's last accumulation (one launch a step)
        self.every_microbatch = shard and every_microbatch
        self.sum_dtype = sum_dtype
        self.alone = frozenset(alone)
        self.params = [p for p in params if p.requires_grad]
        self.uses = uses                      # id(param) -> accumulations per microbatch
        # backward visits parameters roughly in reverse: fill buckets from the end; under sharding
        # a bucket holds one dtype, and a parameter in ``alone`` (ids) is a bucket of its own
        self.buckets: List[List[nn.Parameter]] = []
        cur, size = [], 0
        limit = bucket_mb * 2**20
        for p in reversed(self.params):
            if shard and cur and (id(p) in alone or p.dtype != cur[-1].dtype):
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit or (shard and id(p) in alone):
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)
        self.pieces: List[Optional[torch.Tensor]] = [None] * len(self.buckets)
        # this rank's parts of the parameters in its pieces (the optimizer's and the norm's), once
        self.segments = segments(self.buckets, world, rank) if shard else []
        # under sharding each bucket's parameters move into one flat buffer, which the updated
        # pieces are all-gathered into in place (``runtime.sharded_dp.adopt``)
        self.param_buffers = [adopt(b, world) for b in self.buckets] if shard and world > 1 else []
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self._expected: Dict[int, int] = {}
        self._count: Dict[int, int] = {}
        self._ready: List[int] = [0] * len(self.buckets)
        self._work: List[Optional[tuple]] = [None] * len(self.buckets)
        self._sums: List[Optional[torch.Tensor]] = [None] * len(self.buckets)   # every_microbatch's pieces
        self._launches = [0] * len(self.buckets)
        self._in_flight: List[tuple] = []        # every_microbatch: (bucket, piece, work, flat), oldest first
        self.active = False
        self.launched_in_backward = 0     # buckets reduced while backward was still running (last step)

    def start(self, microbatches: int) -> None:
        """Arm for one step of ``microbatches``."""
        if self.shard and any(x is not None for x in self.pieces):
            raise ShardingError("train_step under dp_shard='optimizer' or 'gradients' while the last step's "
                                "reduced gradients are still waiting for the optimizer: build it with "
                                "pm.adamw(...) (an optimizer over pm.parameters() sees no gradients: each rank "
                                "keeps only its share of them) and call its step() between train_steps")
        self._expected = {id(p): microbatches * self.uses.get(id(p), 1) for p in self.params}
        self._count = {id(p): 0 for p in self.params}
        self._ready = [0] * len(self.buckets)
        self._work = [None] * len(self.buckets)
        self._sums = [None] * len(self.buckets)
        self._launches = [0] * len(self.buckets)
        self._in_flight = []
        self.launched_in_backward = 0
        # a group of one still divides (expert parallelism over every dp rank: the experts' sum is whole)
        self.active = self.world > 1 or self.divisor != 1

    def _hook(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        k = id(p)
        self._count[k] += 1
        b = self.bucket_of[k]
        if self.every_microbatch:
            # a parameter's level: the microbatches it has finished. The bucket goes when all of its
            # parameters are past its last launch; any split of the accumulations into launches
            # sums to the same, each accumulation being reduced once
            if self._level(p) != self._launches[b] + 1 or self._count[k] % self.uses.get(k, 1):
                return
        elif self._count[k] != self._expected[k]:
            return
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._launch(b)
            self.launched_in_backward += 1

    def _level(self, p: nn.Parameter) -> int:
        return self._count[id(p)] // self.uses.get(id(p), 1)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if not self.shard and self.world == 1:
            # a group of one (the experts' at dp = ep): nothing to sum; ``finish`` divides each
            # gradient where it is, not through a flat copy and back (three passes over them)
            self._work[b] = (None, Done(), None)
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        if not self.shard:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._work[b] = (flat, all_reduce(flat, self.group) if self.world > 1 else Done(), None)
            return
        piece, work, flat = reduce_scatter_bucket(grads, self.world, self.group)
        for p in bucket:       # what the optimizer reads is the piece
            p.grad = None
        if not self.every_microbatch:
            self._work[b] = (piece, work, flat)
            return
        # a parameter ahead of the others has its microbatches summed in this launch already
        self._launches[b] = max(self._launches[b] + 1, min(self._level(p) for p in bucket))
        self._ready[b] = sum(self._level(p) > self._launches[b] for p in bucket)
        self._in_flight.append((b, piece, work, flat))
        # at most two launches in flight: the whole gradient each holds is freed when it is summed
        while len(self._in_flight) > 2:
            self._retire()

    def _retire(self) -> None:
        b, piece, work, _ = self._in_flight.pop(0)
        work.wait()
        dtype = self.sum_dtype or piece.dtype
        if self._sums[b] is None:
            self._sums[b] = piece if piece.dtype == dtype else piece.to(dtype)
        else:
            self._sums[b].add_(piece)

    def finish(self) -> None:
        """Launch the buckets still waiting, wait for all, write the averages into ``.grad``
        (under sharding: into this rank's ``pieces``)."""
        if not self.active:
            return
        for b, bucket in enumerate(self.buckets):
            if self.every_microbatch:       # gradients not yet launched, or a bucket that got none at all
                if self._sums[b] is None and not any(x[0] == b for x in self._in_flight) or any(
                        p.grad is not None for p in bucket):
                    self._launch(b)
            elif self._work[b] is None:
                self._launch(b)
        if self.every_microbatch:
            while self._in_flight:
                self._retire()
            for b, flat in enumerate(self._sums):
                dtype = self.buckets[b][0].dtype
                if self.replicas is not None:
                    all_reduce(flat, self.replicas).wait()
                self.pieces[b] = (flat if flat.dtype == dtype else flat.to(dtype)).div_(self.divisor)
            self._sums = [None] * len(self.buckets)
            self.active = False
            return
        for b, (flat, work, _) in enumerate(self._work):
            work.wait()
            if flat is None:        # a group of one (``_launch``)
                for p in self.buckets[b]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    elif self.divisor != 1:
                        p.grad.div_(self.divisor)
                continue
            if self.shard and self.replicas is not None:
                all_reduce(flat, self.replicas).wait()
            if self.divisor != 1:
                flat.div_(self.divisor)
            if self.shard:
                self.pieces[b] = flat
                continue
            off = 0
            for p in self.buckets[b]:
                n = p.numel()
                g = flat[off:off + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                off += n
        self._work = [None] * len(self.buckets)
        self.active = False

    def piece_of(self) -> Dict[int, torch.Tensor]:
        """id(param) -> this rank's piece of its bucket, for the parameters alone in theirs."""
        return {id(b[0]): self.pieces[i] for i, b in enumerate(self.buckets)
                if len(b) == 1 and self.pieces[i] is not None}

    def whole_grads(self) -> Dict[int, torch.Tensor]:
        """id(param) -> its whole reduced gradient, put together from every rank's pieces
        (collective over the group)."""
        out = {}
        for piece, bucket in zip(self.pieces, self.buckets):
            if piece is not None:
                flat = piece.new_empty(piece.numel() * self.world)
                all_gather(flat, piece, self.group)
                offsets, _ = bucket_layout([p.numel() for p in bucket], self.world)
                out.update({id(p): flat[o:o + p.numel()].view_as(p) for p, o in zip(bucket, offsets)})
        return out

    def named_pieces(self, names: Dict[int, str]) -> List[Tuple[str, torch.Tensor]]:
        """(parameter name, this rank's reduced segment of it) for every segment (``names``:
        id(param) -> name)."""
        return [(names[id(s.param)], self.pieces[s.bucket][s.at:s.at + s.numel])
                for s in self.segments if self.pieces[s.bucket] is not None]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def check_same_weights(named: Iterable[Tuple[str, torch.Tensor]], axes: Mapping, replicated: Callable[[str], bool],
                       shared: Collection[str], known: Optional[Mapping[str, str]] = None,
                       apart: Collection[str] = (), after: str = "") -> None:
    """Raise ``ReplicaError`` on every rank, naming the first parameter and the ranks, when ranks
    that must hold the same values of a parameter do not: the data-parallel replicas (with the cp
    ranks of each), the tp ranks of a parameter replicated over tp (``replicated(name)``) and
    the pipeline ranks holding their own copy of a tied weight (``shared``). Collective over
    dp, cp, tp and pp and the default group; a digest per parameter is all that moves.

    Why refuse rather than broadcast dp rank 0's weights as DDP does: each tp shard and each
    pipeline stage is cut from its own rank's copy of the model, so ranks that built the model
    differently (another seed, weights loaded on rank 0 alone) would still train a mixture
    across tp and pp after a broadcast over dp; a refusal names the cause in every layout,
    leaves the caller's weights as they are, and costs a hash of each local shard rather than
    a copy of every weight. ``known``: digests of parameters whose tensors here are not what
    the ranks compare (``dp_shard="full"`` keeps a shard: the digest of the whole local piece
    it was cut from). ``apart``: parameters left out of the data-parallel comparisons (the ranks
    hold different pieces of them). ``after``: the check runs after training began (``"after
    step 12"``): the message then says what parts replicas that started equal."""
    named = list(named)
    known = known or {}
    apart = frozenset(apart)
    checks = [(axes.get("dp_cp", axes["dp"]), "data-parallel replicas", lambda n: n not in apart),
              (axes.get("dp_replicate", Axis()), "replica groups of hybrid sharding", lambda n: n not in apart),
              (axes["tp"], "tp ranks (it is replicated over tp)", replicated),
              (axes["pp"], "pipeline ranks holding a copy of this tied weight", lambda n: n in shared)]
    checks = [c for c in checks if c[0].size > 1]
    if not checks:      # no mesh dim to compare over; and not every process may be here
        return
    digests: Dict[str, str] = {}
    problem = None
    for ax, who, wanted in checks:
        for n, p in named:
            if wanted(n) and n not in digests:
                digests[n] = known[n] if n in known else weight_digest(p)
        mine = {n: digests[n] for n, _ in named if wanted(n)}
        every: List[Optional[Dict[str, str]]] = [None] * ax.size
        dist.all_gather_object(every, mine, group=ax.group)
        for n in mine:
            held = [(r, d[n]) for r, d in zip(ax.ranks, every) if n in d]
            odd = [r for r, d in held if d != held[0][1]]
            if odd and problem is None:
                same = [r for r, d in held if d == held[0][1]]
                problem = (f"parameter {n!r} differs between the {who}{' ' + after if after else ''}: global "
                           f"rank(s) {same} hold one value and {odd} another: ")
                problem += ("the ranks no longer train one model, and no loss shows it. They started equal: an "
                            "update that was not the same on every rank parted them (a gradient each rank computes "
                            "alone on kernels that round differently is averaged for weights replicated over tp, "
                            "docs/TENSOR_PARALLEL.md#replicated-weights; report the layout)" if after else
                            "they would train different models and no loss would show it. Build the model the same "
                            "way on every rank (torch.manual_seed(S) before constructing it, or the same weights "
                            "loaded on every rank), or pass state_dict=")
    found: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)      # every rank raises, none is left waiting in a collective
    first = next((f for f in found if f is not None), None)
    if first is not None:
        raise ReplicaError(first)
