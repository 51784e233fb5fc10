"""Sequence parallelism's all-gather in FP8: each rank quantises its sequence shard and the
group gathers FP8 bytes (and per-row scales) instead of bf16 activations.

Under sequence parallelism, a column-parallel linear's input is ``gather_seq(x)``: the
shards of the sequence, all-gathered (``ops.collectives``). When every reader of that gather
is an FP8 linear, the linears need the gathered tensor only as FP8 operands
(``ops.fp8_operands``: x [tokens, in] quantised along in features, and its transposed copy
quantised along tokens) and as the place their input gradients meet. So:

* ``fp8_gather_quantize(x, recipe, dim, world, group)`` gives the four operands that
  ``fp8_quantize(gather_seq(x))`` gives, byte for byte, from the shard. An element's FP8 value
  depends only on the element and its scale, and each scale is an amax over the same
  elements as in the gathered tensor: tensorwise, the shard's amax max-reduced over the
  group; rowwise, a row is a token, and a token lives whole on one rank, so row amaxes are
  the shard's own, while a column (an in feature over all tokens) is max-reduced. Then the
  row-major FP8 shard (and its row scales) is all-gathered: half of the bf16 bytes.
  Tensorwise, the transposed copy is the gathered bytes transposed (one scale); rowwise it
  has per-column scales, so the shards' transposed copies are gathered too.
* ``fp8_gathered_input(x, dim, world, group)`` stands where the linears read the gathered
  bf16 tensor: its forward moves nothing (a zero-stride tensor of the gathered shape: the
  linears read only its dtype), its backward is the gather's, the reduce-scatter of the
  summed input gradients onto the shards. ``fp8_gathered_whole_input`` does the same for
  ``all_gather_seq`` (a replicated weight's linear: the gradient is whole on every rank, and
  each keeps its slice).

Preconditions (checked by ``passes/fp8_gather.py``): the gather is over the sequence, not the
last (feature) dim; the quantisation's amax groups are the gather's group or none (the
gathered tensor is the same on every rank of the group).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from fxmegatron.ops.collectives import all_gather, local_shard, reduce_scatter
from fxmegatron.ops.fp8 import E4M3, quantize, quantize_pair, recipe_of
from fxmegatron.ops.registry import register


def _gather(t: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    """``all_gather`` along ``dim``; FP8 travels as its bytes (gloo has no FP8 type)."""
    if t.element_size() != 1:
        return all_gather(t, dim, world, group_name)
    return all_gather(t.view(torch.uint8), dim, world, group_name).view(t.dtype)


def _check(x: Tensor, dim: int, world: int) -> int:
    d = dim % x.dim()
    if d == x.dim() - 1 or world < 1:
        raise ValueError(f"fp8_gather_quantize: dim {dim} of a {x.dim()}-D input is the feature dim "
                         f"(or world {world} < 1): only a gather over tokens keeps whole rows")
    return d


@torch.library.triton_op("fxmegatron::fp8_gather_quantize", mutates_args=())
def fp8_gather_quantize(x: Tensor, recipe: str, dim: int, world: int,
                        group_name: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, scale, qt, scale_t) of ``gather_seq(x, dim, world, group_name)`` as ``fp8_quantize``
    makes them with amax groups ``group_name`` (see the module docstring), from the shard ``x``."""
    d = _check(x, dim, world)
    r = recipe_of(recipe)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if not r.rowwise:
        q, s = quantize(x, r, E4M3, group_name)
        qg = _gather(q.view(*lead, k), d, world, group_name).view(-1, k)
        return qg, s, qg.t().contiguous(), s.clone()
    q, s, qt, st = quantize_pair(x, r, E4M3, "", group_name)
    qg = _gather(q.view(*lead, k), d, world, group_name).view(-1, k)
    sg = _gather(s.view(*lead, 1), d, world, group_name).view(-1, 1)
    # xᵀ's columns are tokens in x's order: gathered along the same dim, one further in
    qtg = _gather(qt.view(k, *lead), d + 1, world, group_name).view(k, -1)
    return qg, sg, qtg, st


class _GatheredInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world, group_name):
        ctx.args = (dim % x.dim(), rank, world, group_name)
        shape = list(x.shape)
        shape[ctx.args[0]] *= world
        # the gathered shape, no bytes behind it: the FP8 linears read only its dtype
        return x.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx, grad):
        dim, rank, world, group_name = ctx.args
        if rank < 0:        # gather_seq's gradient: partial sums, reduce-scattered
            return reduce_scatter(grad.contiguous(), dim, world, group_name), None, None, None, None
        # all_gather_seq's: whole on every rank, this rank's slice kept
        return local_shard(grad, dim, rank, world).contiguous(), None, None, None, None


def fp8_gathered_input(x: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    """``gather_seq(x, ...)`` for readers that need only its shape, dtype and gradient: no
    forward communication, reduce-scatter backward (see the module docstring)."""
    return _GatheredInput.apply(x, dim, -1, world, group_name)


register(fp8_gathered_input, "gather_seq_grad", "no forward communication (the values travel in FP8), "
         "reduce-scatter backward", (3,), needs_group=True)


def fp8_gathered_whole_input(x: Tensor, dim: int, rank: int, world: int, group_name: str) -> Tensor:
    """``all_gather_seq(x, ...)`` (whose readers' gradient is whole on every rank: a replicated
    weight's linear) for readers that need only its shape, dtype and gradient: no forward
    communication, this rank's slice of the gradient backward."""
    return _GatheredInput.apply(x, dim, rank, world, group_name)


register(fp8_gathered_whole_input, "all_gather_seq_grad", "no forward communication (the values travel in "
         "FP8), local slice backward", (4,), needs_group=True)


def gather_quantize_operand(x: Tensor, recipe: str, dim: int, world: int, group_name: str):
    """The graph's call target for ``fp8_gather_quantize`` (stage folders import it)."""
    return fp8_gather_quantize(x, recipe, dim, world, group_name)


register(gather_quantize_operand, "fp8_gather_seq", "all-reduce(max) of the shard's amaxes, all-gather(seq) of "
         "its FP8 bytes (rowwise: and row scales, and the transposed copy)", (4,), needs_group=True)
