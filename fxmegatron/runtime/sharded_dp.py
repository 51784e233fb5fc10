"""Sharded data parallelism, ``dp_shard="optimizer"`` (ZeRO-1 / Megatron's distributed optimizer):
which elements of each gradient bucket a data-parallel rank owns, and putting the updated
parameters back together.

``GradSync`` (``runtime.data_parallel``) cuts the gradients into buckets, in the order backward
produces them. Under sharding a bucket's flat gradient (its parameters one after the other,
zero-padded to a multiple of the group's size ``world``) is reduce-scattered: rank ``r`` gets
the sum of elements ``[r·S, (r+1)·S)``, ``S = padded / world``, and only those. A parameter
may straddle two ranks' pieces; a ``Segment`` is the part of one parameter inside this rank's
piece. The optimizer keeps fp32 masters, m and v for the segments only, updates them, and
``launch_gather`` / ``finish_gather`` all-gather each bucket's updated values into every rank's
parameters.

Each bucket's parameters live in one flat buffer laid out as its gradient (``adopt``: Megatron's
parameter buffer), so this rank's piece of the buffer is where the optimizer writes its
segments, and the all-gather fills the buffer in place: no copy of the updated values into a
piece and out of a gathered buffer, two passes over every parameter and hundreds of small
kernels a step. A parameter whose storage was replaced since (``p.data = ...``) no longer lies
in its buffer: its bucket is then gathered through copies, as before.

A weight that several pipeline ranks hold (a tied embedding and LM head) is a bucket of its
own: its pieces are then the same elements on every holder, and the holders' pieces are
summed over the pipeline group as the whole gradients are without sharding
(``sum_shared_pieces``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fxmegatron.mesh import Axis
from fxmegatron.ops.groups import communicator, nccl_like

DP_SHARD_MODES = ("none", "optimizer", "gradients", "full")
SHARDED_OPTIMIZER = ("optimizer", "gradients")      # the modes whose optimizer is ShardedAdamW over pieces


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of ``param`` (flattened) are elements ``[at, at + stop - start)``
    of this rank's piece of bucket ``bucket``."""
    param: nn.Parameter
    bucket: int
    start: int
    stop: int
    at: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


ALIGN = 64      # elements: a parameter's place in its bucket, and each rank's piece, start at multiples


def bucket_layout(numels: Sequence[int], world: int) -> Tuple[List[int], int]:
    """(each parameter's offset in the bucket's flat buffer, the buffer's length). Offsets and
    the length of a rank's piece are multiples of ``ALIGN`` elements, so every segment and its
    place in the piece start 128-byte aligned for bf16 (the optimizer's vector loads need 16);
    the gaps hold zeros in the gradient buffer."""
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end = -(-(end + n) // ALIGN) * ALIGN
    return offsets, -(-max(end, 1) // (ALIGN * world)) * ALIGN * world


def padded_numel(bucket: Sequence[nn.Parameter], world: int) -> int:
    """The bucket's flat length (``bucket_layout``)."""
    return bucket_layout([p.numel() for p in bucket], world)[1]


def segments(buckets: Sequence[Sequence[nn.Parameter]], world: int, rank: int) -> List[Segment]:
    """The parts of the parameters inside rank ``rank``'s piece of each bucket, in bucket order."""
    out: List[Segment] = []
    for b, bucket in enumerate(buckets):
        offsets, padded = bucket_layout([p.numel() for p in bucket], world)
        piece = padded // world
        lo, hi = rank * piece, (rank + 1) * piece
        for p, off in zip(bucket, offsets):
            a, c = max(lo, off), min(hi, off + p.numel())
            if a < c:
                out.append(Segment(p, b, a - off, c - off, a - lo))
    return out


class Done:
    """The work of a collective that has already happened (on a simulated group)."""

    def wait(self) -> None:
        return None


def _simulated(group) -> bool:
    """``group`` is a simulated group's name (``ops.groups``: ``verify`` runs the data-parallel
    ranks as threads), not a process group."""
    return isinstance(group, str)


def reduce_scatter_bucket(grads: Sequence[torch.Tensor], world: int, group):
    """(this rank's piece, the work, the flat input kept alive until the work ends)."""
    offsets, padded = bucket_layout([g.numel() for g in grads], world)
    if world > 1 and len(grads) == 1 and grads[0].numel() == padded and grads[0].is_contiguous():
        # one parameter filling its bucket (a large weight): reduce-scattered where it is. Its
        # gradient is only read (the piece is another tensor) and is dropped by the caller
        flat = grads[0].view(-1)
    else:
        flat = grads[0].new_zeros(padded)
        torch._foreach_copy_([flat[o:o + g.numel()] for o, g in zip(offsets, grads)],
                             [g.reshape(-1) for g in grads])
    if world == 1:          # a group of one (the experts' at dp = ep): the piece is the bucket
        return flat, Done(), flat
    piece = flat.new_empty(padded // world)
    if _simulated(group):
        piece.copy_(communicator(group).reduce_scatter(flat.view(world, -1)))
        return piece, Done(), flat
    return piece, dist.reduce_scatter_tensor(piece, flat, group=group, async_op=True), flat


def all_reduce(flat: torch.Tensor, group):
    """Sum ``flat`` over the group in place; the work."""
    if _simulated(group):
        flat.copy_(communicator(group).all_reduce(flat))
        return Done()
    return dist.all_reduce(flat, group=group, async_op=True)


def all_gather(out: torch.Tensor, piece: torch.Tensor, group, async_op: bool = False):
    """Every rank's ``piece`` into ``out``, in rank order."""
    if out.numel() == piece.numel():        # a group of one
        out.copy_(piece.reshape(-1))
        return Done() if async_op else None
    if _simulated(group):
        out.copy_(communicator(group).all_gather(piece).reshape(-1))
        return Done() if async_op else None
    # torch 2.13 renamed all_gather_into_tensor (deprecated there); the GPU machines have 2.11
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, piece, group=group, async_op=async_op)


@torch.no_grad()
def adopt(bucket: Sequence[nn.Parameter], world: int) -> torch.Tensor:
    """One flat buffer laid out as ``bucket``'s gradient (``bucket_layout``, the gaps zero), holding
    the parameters' values; each parameter's storage becomes its place there."""
    offsets, padded = bucket_layout([p.numel() for p in bucket], world)
    flat = torch.zeros(padded, dtype=bucket[0].dtype, device=bucket[0].device)
    for p, o in zip(bucket, offsets):
        flat[o:o + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[o:o + p.numel()].view_as(p)
    return flat


def in_buffer(bucket: Sequence[nn.Parameter], flat: Optional[torch.Tensor], world: int) -> bool:
    """Whether every parameter of ``bucket`` still lies where ``adopt`` put it in ``flat``."""
    if flat is None or flat.device.type == "meta":
        return False
    offsets, _ = bucket_layout([p.numel() for p in bucket], world)
    base, size = flat.data_ptr(), flat.element_size()
    return all(p.data_ptr() == base + o * size and p.is_contiguous() for p, o in zip(bucket, offsets))


@torch.no_grad()
def launch_gather(buckets: Sequence[Sequence[nn.Parameter]], which: Sequence[int], segs: Sequence[Segment],
                  world: int, group, rank: int = 0, buffers: Sequence[Optional[torch.Tensor]] = ()) -> list:
    """Start the all-gathers of buckets ``which`` from this rank's updated segments ``segs``
    (of those buckets); ``finish_gather`` waits for them and writes every rank's parameters.
    ``buffers``: the buckets' parameter buffers (``adopt``), gathered into in place where the
    parameters still lie in them (this rank ``rank``'s piece is then the updated one)."""
    if world == 1:
        # a group of one (the experts' at dp = ep): the segments are the whole parameters, whose
        # storage the optimizer updated in place; gathering would copy every one four times
        return []
    by_bucket: Dict[int, List[Segment]] = {}
    for s in segs:
        by_bucket.setdefault(s.bucket, []).append(s)
    pending = []
    for b in which:
        bucket = buckets[b]
        padded = padded_numel(bucket, world)
        flat = buffers[b] if b < len(buffers) else None
        if in_buffer(bucket, flat, world):
            n = padded // world
            piece = flat[rank * n:(rank + 1) * n]
            if not _simulated(group) and not nccl_like(group):
                piece = piece.clone()       # gloo: no input inside the output
            pending.append((b, None, all_gather(flat, piece, group, async_op=True), piece))
            continue
        piece = torch.zeros(padded // world, dtype=bucket[0].dtype, device=bucket[0].device)
        mine = by_bucket.get(b, ())
        if mine:
            torch._foreach_copy_([piece[s.at:s.at + s.numel] for s in mine],
                                 [s.param.detach().view(-1)[s.start:s.stop] for s in mine])
        out = piece.new_empty(padded)
        pending.append((b, out, all_gather(out, piece, group, async_op=True), piece))
    return pending


@torch.no_grad()
def finish_gather(buckets: Sequence[Sequence[nn.Parameter]], pending: list) -> None:
    for b, out, work, _ in pending:
        work.wait()         # on a GPU the stream waits, not the host
        if out is None:     # gathered into the parameters' own buffer
            continue
        offsets, _ = bucket_layout([p.numel() for p in buckets[b]], 1)
        torch._foreach_copy_([p.detach().view(-1) for p in buckets[b]],
                             [out[o:o + p.numel()] for o, p in zip(offsets, buckets[b])])


def sum_shared_pieces(params: Mapping[str, nn.Parameter], shared: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
                      piece_of: Mapping[int, torch.Tensor], world: int, pp: Axis, device) -> None:
    """``gather.sum_shared_grads`` on the pieces of the shared weights' own buckets: one
    all-reduce over the pipeline group; a rank without the weight adds zeros."""
    if not shared or pp.size == 1:
        return
    flat = []
    for name, (shape, dtype) in shared.items():
        p = params.get(name)
        got: Optional[torch.Tensor] = piece_of.get(id(p)) if p is not None else None
        flat.append(got if got is not None else
                    torch.zeros(bucket_layout([math.prod(shape)], world)[1] // world, dtype=dtype, device=device))
    buf = torch.cat(flat)
    dist.all_reduce(buf, group=pp.group)
    off = 0
    for name, (shape, _) in shared.items():
        n = bucket_layout([math.prod(shape)], world)[1] // world
        p = params.get(name)
        if p is not None and id(p) in piece_of:
            piece_of[id(p)].copy_(buf[off:off + n])
        off += n
