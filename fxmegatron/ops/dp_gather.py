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
``torch.compile``).

``functional``: the gather and the reduce-scatter are torch's functional collectives
(``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` and their
``wait_tensor``) rather than fxmegatron's opaque ops. Under ``torch.compile`` inductor then sees
each collective's start and its wait apart, so its overlap scheduler
(``lower.torch_compile``, ``aten_distributed_optimizations``) can issue a block's gather ahead
of the previous block's compute and wait for a reduce-scatter late: the prefetch and the
overlap are scheduling decisions on the compiled graph, as in torchtitan's SimpleFSDP."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
from torch import Tensor

from fxmegatron.ops.collectives import all_gather, all_reduce, reduce_scatter
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


def _gather(shards: Sequence[Tensor], world: int, group_name: str, functional: bool = False) -> tuple:
    """Each parameter's ``world`` shards one after the other (flat), from one all-gather."""
    flat = torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].reshape(-1)
    if functional:
        from torch.distributed import _functional_collectives as funcol
        out = funcol.wait_tensor(funcol.all_gather_tensor(flat, 0, group_name))
    else:
        out = all_gather(flat, 0, world, group_name)
    if len(shards) == 1:
        return (out,)
    # rank-major [world, Σ shard] -> each parameter's world shards one after the other
    return tuple(p.reshape(-1) for p in out.view(world, -1).split([s.numel() for s in shards], dim=1))


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, world, divisor, group_name, functional, replicas, *shards):
        ctx.args = (world, divisor, group_name, functional, replicas, [s.numel() for s in shards])
        return _gather(shards, world, group_name, functional)

    @staticmethod
    def backward(ctx, *grads):
        world, divisor, group_name, functional, replicas, lengths = ctx.args
        if len(lengths) == 1:
            flat = grads[0]
        else:
            flat = torch.cat([g.reshape(world, n) for g, n in zip(grads, lengths)], dim=1).reshape(-1)
        if functional:
            from torch.distributed import _functional_collectives as funcol
            piece = funcol.wait_tensor(funcol.reduce_scatter_tensor(flat, "sum", 0, group_name))
        else:
            piece = reduce_scatter(flat, 0, world, group_name)
        if replicas:        # hybrid sharding: the same shard's sums of the other replica groups added
            if functional:
                piece = funcol.wait_tensor(funcol.all_reduce(piece, "sum", replicas))
            else:
                piece = all_reduce(piece, "sum", replicas)
        if divisor != 1:
            piece = piece / divisor
        return (None, None, None, None, None) + tuple(piece.split(lengths))


def _gather_again():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(lambda ctx, func, *a, **k: CheckpointPolicy.MUST_RECOMPUTE)


def _unshard(world, divisor, group_name, functional, replicas, shapes, *shards):
    flats = _Unshard.apply(world, divisor, group_name, functional, replicas, *shards)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # eager: mark each whole parameter, so that ``regather_in_backward`` keeps the shards rather than it
        group = _Gathered(shards, world, group_name)
        for i, f in enumerate(flats):
            f._fxm_gathered = (group, i)
    return [whole(f, s) for f, s in zip(flats, shapes)]


class _Gathered:
    """One group's whole parameters as a forward gathered them: the backward gathers them again
    from the shards, once, when the first of them is unpacked, and drops them after the last."""

    def __init__(self, shards, world: int, group_name: str):
        self.shards, self.world, self.group_name = [s.detach() for s in shards], world, group_name
        self.saved = 0
        self.again = None

    def unpack(self, i: int) -> Tensor:
        if self.again is None:
            with torch.no_grad():
                self.again = _gather(self.shards, self.world, self.group_name)
        t = self.again[i]
        self.saved -= 1
        if self.saved == 0:
            self.again = None
        return t


def _pack(t: Tensor):
    root = t._base if t._base is not None else t
    mark = getattr(root, "_fxm_gathered", None)
    if mark is None:
        return t
    mark[0].saved += 1
    return mark + (t.size(), t.stride(), t.storage_offset())


def _unpack(x):
    if isinstance(x, Tensor):
        return x
    group, i, size, stride, offset = x
    return group.unpack(i).as_strided(size, stride, offset)


def regather_in_backward():
    """A context for an eager forward under ``dp_shard="full"``: what autograd saves of a whole
    parameter (``unshard``'s output, or a view of it) is kept as a reference to its shards, and
    the backward all-gathers the group again when it needs it, so the whole parameters live from
    their block's forward to its end and again during its backward, not in between."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def unshard(shards: List[Tensor], shapes: List[List[int]], world: int, divisor: int, group_name: str,
            recompute: bool = False, functional: bool = False, replicate_group: str = "") -> List[Tensor]:
    """The whole parameters of ``shards`` (each of ``shapes``): one all-gather forward, one
    reduce-scatter (divided by ``divisor``) backward. ``recompute``: every op of the gather
    tagged to be recomputed (a checkpoint whose policy recomputes all), so that a compiled
    backward gathers again rather than keeping the whole parameters from the forward.
    ``functional``: through torch's functional collectives (see the module's docstring); the
    group must then be a torch.distributed process group, not a simulated one. ``replicate_group``:
    hybrid sharding's group of the ranks holding the same shards; the reduce-scattered gradient is
    summed over it before the division (empty: no replicas)."""
    if recompute and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint
        return checkpoint(_unshard, world, divisor, group_name, functional, replicate_group, shapes, *shards,
                          use_reentrant=False, context_fn=_gather_again)
    return _unshard(world, divisor, group_name, functional, replicate_group, shapes, *shards)


register(unshard, "unshard", "all-gather(parameter shards) forward, reduce-scatter(gradients)/dp backward", (4, 7),
         detail=lambda args: [f"{len(args[0])} parameter(s), {sum(math.prod(s) for s in args[1]):,} elements, "
                              f"{args[2]} shards"])
