"""The graph functions context parallelism inserts, each a named node in the dump.

Rank r of ``cp`` holds sequence chunks r and 2·cp−1−r of 2·cp (load-balanced for causal
attention: ``fxmegatron.ops.context_attention.load_balanced_index``).

* ``cp_take``: this rank's chunks of a tensor that every rank computed whole (a position
  table, shifted labels); its backward puts the gradient back at those positions.
* ``cp_attention``: attention whose keys and values come from every cp rank (a ring of
  P2P exchanges or an all-gather, ``variant``: ``fxmegatron.ops.context_attention``), a
  ``torch.library`` op returning (out, lse) with its backward another op, so fake
  tensors, the tensor-parallel rules and torch.compile see one opaque call each way.
* ``cp_sum``: a partial sum over the cp ranks made whole (all-reduce forward, identity
  backward: each rank's backward starts from its own share).
* ``cp_count``: the number of counted tokens over all cp ranks (a mean's divisor).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from fxmegatron.ops.attention_blocks import in_q_order, like_q
from fxmegatron.ops.collectives import all_reduce, reduce_from_tp
from fxmegatron.ops.groups import communicator, resolve_group
from fxmegatron.ops.registry import register


def cp_take(x: Tensor, dim: int, inner: int, seq: int, cp: int, rank: int) -> Tensor:
    """Rank ``rank``'s two chunks of the sequence held in ``dim`` of ``x``, where ``dim`` is
    laid out as [outer, seq, inner] (a flattened batch and sequence has ``inner`` 1)."""
    size = x.shape[dim]
    c = seq // (2 * cp)
    shape = list(x.shape)
    y = x.reshape(shape[:dim] + [size // (seq * inner), seq, inner] + shape[dim + 1:])
    d = dim + 1
    y = torch.cat([y.narrow(d, rank * c, c), y.narrow(d, (2 * cp - 1 - rank) * c, c)], d)
    shape[dim] = size // cp
    return y.reshape(shape)


def cp_sum(x: Tensor, group_name: str) -> Tensor:
    """Sum of every cp rank's share; the gradient of each share is the incoming gradient."""
    return reduce_from_tp(x, group_name)


register(cp_sum, "cp_sum", "all-reduce(sum) forward, identity backward", (1,))


def cp_count(target: Tensor, ignore_index: int, group_name: str) -> Tensor:
    """How many entries of ``target`` over all cp ranks are not ``ignore_index`` (no gradient)."""
    n = (target != ignore_index).sum().to(torch.float32)
    return all_reduce(n, "sum", group_name)


register(cp_count, "cp_count", "all-reduce(sum) of the counted tokens, no gradient", (2,))


@torch.library.custom_op("fxmegatron::cp_attention", mutates_args=())
def _cp_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float], group_name: str,
                  cp: int, rank: int, variant: str) -> Tuple[Tensor, Tensor]:
    """(out, lse): attention of this rank's queries over every rank's keys and values. lse (fp32,
    [B, H, S_local]) is returned for the backward, which works from the final out and lse."""
    from fxmegatron.ops.context_attention import attention_plan, run_forward
    out, lse = run_forward(attention_plan(cp, rank, is_causal, variant), q, k, v, scale=_scale(scale, q),
                           transport=_transport(group_name))
    return out, lse


@_cp_attention.register_fake
def _(q, k, v, is_causal, scale, group_name, cp, rank, variant):
    # the layouts run_forward gives: out in q's order of dimensions, lse dense
    return in_q_order(q.shape[:-1] + v.shape[-1:], q, q.dtype), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fxmegatron::cp_attention_backward", mutates_args=())
def _cp_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool,
                           scale: Optional[float], group_name: str, cp: int, rank: int,
                           variant: str) -> Tuple[Tensor, Tensor, Tensor]:
    from fxmegatron.ops.context_attention import attention_plan, run_backward
    dq, dk, dv = run_backward(attention_plan(cp, rank, is_causal, variant), dout, q, k, v, out, lse,
                              scale=_scale(scale, q), transport=_transport(group_name))
    # dk and dv are halves of one fp32 buffer, cast to the inputs' dtype: views of it when that
    # is fp32, and an op's outputs may not alias
    if dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr():
        dv = dv.clone()
    return dq, dk, dv


@_cp_attention_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale, group_name, cp, rank, variant):
    # as run_backward computes them: dq in q's order of dimensions, dk and dv dense
    return in_q_order(q.shape, q, q.dtype), k.new_empty(k.shape), v.new_empty(v.shape)


def _scale(scale, q):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)      # SDPA's default


def _transport(group_name: str):
    from fxmegatron.ops.context_attention import ProcessGroupTransport
    if group_name.startswith("sim:"):     # ranks simulated in this process (verify): the same exchanges
        return communicator(group_name)
    return ProcessGroupTransport(resolve_group(group_name))


def _setup(ctx, inputs, output):
    ctx.args = inputs[3:]
    ctx.save_for_backward(*inputs[:3], *output)


def _backward(ctx, dout, dlse):
    # lse is the op's own: the graph reads out alone (``getitem 0``), so dlse is None or zeros
    q, k, v, out, lse = ctx.saved_tensors
    # dout laid out as out (q's order: what the output projection's backward gives, uncopied)
    dq, dk, dv = _cp_attention_backward(like_q(dout, q), q, k, v, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


_cp_attention.register_autograd(_backward, setup_context=_setup)
# the graph's call target (an OpOverload: the dump names it, the tp rules look it up); the graph
# reads its output 0, the attention
cp_attention = torch.ops.fxmegatron.cp_attention.default


def attention_steps(node_args) -> str:
    """The exchanges, blocks and merges one ``cp_attention`` call runs (its args as in the
    graph), one line each: what the dump prints under the node."""
    from fxmegatron.ops.context_attention import attention_plan, describe
    causal, cp, rank, variant = node_args[3], node_args[6], node_args[7], node_args[8]
    return describe(attention_plan(cp, rank, causal, variant))


register(cp_attention, "cp_attention", "keys/values from every cp rank (forward), their gradients back "
         "(backward)", (5,), detail=attention_steps)
