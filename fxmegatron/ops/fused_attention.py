"""``fxmegatron::attention``: ``scaled_dot_product_attention`` without mask or dropout, as one
fused kernel call each way whose backward fxmegatron makes itself (``attention_blocks``: cuDNN's
kernel, else flash's; plain math where neither takes the inputs, as on the CPU).

Why not aten's SDPA: on CUDA its cuDNN backward is picked from a per-thread cache that another
model in the process can fill with a graph for another grad-output layout, and the gradients
come out wrong with no error (``ops/own_thread.py``). This op's backward lays its operands out
one way and runs cuDNN on fxmegatron's own thread. The pass ``passes/attention_kernel.py`` puts
it in place of SDPA on CUDA; a ``torch.library`` op, so fake tensors and torch.compile see one
opaque call each way.

Shapes as SDPA's with ``enable_gqa``: q [B, H, Sq, D]; k, v [B, Hkv, Sk, D], H % Hkv == 0.
``is_causal`` with Sq == Sk (top-left aligned, as SDPA's).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from fxmegatron.ops.attention_blocks import block_backward, block_forward, in_q_order, like_q


def _scale(scale: Optional[float], q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)     # SDPA's default


@torch.library.custom_op("fxmegatron::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    """(out, lse): out in q's dtype, lse fp32 [B, H, Sq] (for the backward)."""
    out, lse = block_forward(q, k, v, causal=is_causal, scale=_scale(scale, q))
    return like_q(out.to(q.dtype), q), lse.contiguous()


@_attention.register_fake
def _(q, k, v, is_causal, scale):
    return in_q_order(q.shape[:-1] + v.shape[-1:], q, q.dtype), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fxmegatron::attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool,
                        scale: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal=is_causal, scale=_scale(scale, q))
    # each gradient dense in its input's order of dimensions, as the fake says
    return like_q(dq.to(q.dtype), q), like_q(dk.to(k.dtype), k), like_q(dv.to(v.dtype), v)


@_attention_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale):
    return in_q_order(q.shape, q, q.dtype), in_q_order(k.shape, k, k.dtype), in_q_order(v.shape, v, v.dtype)


def _setup(ctx, inputs, output):
    ctx.args = inputs[3:]
    ctx.save_for_backward(*inputs[:3], *output)


def _backward(ctx, dout, dlse):
    # the graph reads out alone (``getitem 0``): dlse is None or zeros
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None


_attention.register_autograd(_backward, setup_context=_setup)
# the graph's call target (the dump names it)
attention = torch.ops.fxmegatron.attention.default
