"""Fully sharded data parallelism's collective (``dp_shard="full"``, ZeRO-3): a block's
parameters put together from every data-parallel rank's shard just before the block runs.

Each parameter (this rank's tensor-parallel piece of it) is held flattened, zero-padded to
``world`` shards of ``shard_length`` elements (a multiple of ``ALIGN``), one per rank of the
group that sums its gradients (dp, or dp × cp under context parallelism). ``unshard`` all-gathers the shards
of a group of parameters in one collective (their shards concatenated: rank-major, as the
gather lays them out) and returns each parameter whole; its backward reduce-scatters the
whole gradients back to the shards, divided by ``divisor`` (the dp degree: replicas average,
cp ranks add), so a shard's ``.grad`` is this rank's piece of the averaged gradient.

Whether the whole parameters stay until the backward or are gathered again is the caller's
choice (``passes.dp_shard``: inside a recomputed block, or tagged for recomputation under
``torch.compile``)."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
from torch import Tensor

from fxmegatron.ops.collectives import all_gather, reduce_scatter
from fxmegatron.ops.registry import register

ALIGN = 64      # elements: every shard's length is a multiple (128-byte aligned in bf16)


def shard_length(numel: int, world: int) -> int:
    """The length of each rank's shard of a parameter of ``numel`` elements."""
    return -(-max(numel, 1) // (ALIGN * world)) * ALIGN


def take_shard(local: Tensor, world: int, rank: int) -> Tensor:
    """Rank ``rank``'s shard of ``local`` (a copy: flattened, zero-padded, sliced)."""
    s = shard_length(local.numel(), world)
    flat = local.detach().reshape(-1)
    out = flat.new_zeros(s)
    lo, hi = rank * s, min((rank + 1) * s, flat.numel())
    if lo < hi:
        out[:hi - lo].copy_(flat[lo:hi])
    return out


def whole(gathered: Tensor, shape: Sequence[int]) -> Tensor:
    """A parameter from its ``world`` shards one after the other (``gathered``, flat)."""
    return gathered[:math.prod(shape)].view(tuple(shape))


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, world, divisor, group_name, *shards):
        ctx.args = (world, divisor, group_name, [s.numel() for s in shards])
        flat = torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].reshape(-1)
        out = all_gather(flat, 0, world, group_name)
        if len(shards) == 1:
            return (out,)
        # rank-major [world, Σ shard] -> each parameter's world shards one after the other
        return tuple(p.reshape(-1) for p in out.view(world, -1).split([s.numel() for s in shards], dim=1))

    @staticmethod
    def backward(ctx, *grads):
        world, divisor, group_name, lengths = ctx.args
        if len(lengths) == 1:
            flat = grads[0]
        else:
            flat = torch.cat([g.reshape(world, n) for g, n in zip(grads, lengths)], dim=1).reshape(-1)
        piece = reduce_scatter(flat, 0, world, group_name)
        if divisor != 1:
            piece = piece / divisor
        return (None, None, None) + tuple(piece.split(lengths))


def _gather_again():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(lambda ctx, func, *a, **k: CheckpointPolicy.MUST_RECOMPUTE)


def _unshard(world, divisor, group_name, shapes, *shards):
    flats = _Unshard.apply(world, divisor, group_name, *shards)
    return [whole(f, s) for f, s in zip(flats, shapes)]


def unshard(shards: List[Tensor], shapes: List[List[int]], world: int, divisor: int, group_name: str,
            recompute: bool = False) -> List[Tensor]:
    """The whole parameters of ``shards`` (each of ``shapes``): one all-gather forward, one
    reduce-scatter (divided by ``divisor``) backward. ``recompute``: every op of the gather
    tagged to be recomputed (a checkpoint whose policy recomputes all), so that a compiled
    backward gathers again rather than keeping the whole parameters from the forward."""
    if recompute and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint
        return checkpoint(_unshard, world, divisor, group_name, shapes, *shards, use_reentrant=False,
                          context_fn=_gather_again)
    return _unshard(world, divisor, group_name, shapes, *shards)


register(unshard, "unshard", "all-gather(parameter shards) forward, reduce-scatter(gradients)/dp backward", (4,),
         detail=lambda args: [f"{len(args[0])} parameter(s), {sum(math.prod(s) for s in args[1]):,} elements, "
                              f"{args[2]} shards"])
