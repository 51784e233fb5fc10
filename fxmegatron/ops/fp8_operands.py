"""``fp8_linear`` split in two: the quantisation of each operand as an op of its own
(``fp8_quantize``), and the linear over FP8 operands (``fp8_linear_q``).

``fp8_linear`` quantises inside the op: x and w in forward, then, in backward, x and w again
along the other dim from the high-precision tensors it saved. As two ops, the graph holds
one ``fp8_quantize`` per operand, and ``passes/fp8_share.py`` gives every linear that reads
the same activation (q, k and v; gate and up) the same node: an activation is read once
for FP8, its transposed copy (the weight gradient's operand) is written in the same pass,
and the backward saves that FP8 copy instead of the high-precision input.

The FP8 values are the ones ``fp8_linear`` computes, byte for byte: the same amaxes over
the same elements and groups, the same scales, the same GEMMs (``ops.fp8``'s docstring has
the recipe table). Only where the casts happen moves.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from fxmegatron.ops.fp8 import E4M3, amax_group, backward_gemms, fp8_gemm, quantize_pair, recipe_of
from fxmegatron.ops.registry import register


def operand_groups(recipe: str, tp_group: str, split: str, role: str) -> Tuple[str, str]:
    """The groups ``fp8_quantize`` max-reduces the amaxes of an operand's rows and of its
    columns over: x is [tokens, in], w is [out, in] (see ``ops.fp8.amax_group``)."""
    r = recipe_of(recipe)
    rows = {"x": "tokens", "w": "out"}[role]
    return amax_group(r, tp_group, split, rows), amax_group(r, tp_group, split, "in")


@torch.library.triton_op("fxmegatron::fp8_quantize", mutates_args=())
def fp8_quantize(x: Tensor, recipe: str, group_rows: str, group_cols: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, scale, qt, scale_t): ``x.reshape(-1, K)`` in e4m3 row-major, quantised along K, and
    its transpose row-major, quantised along the other dim (``ops.fp8.quantize_pair``)."""
    return quantize_pair(x, recipe, E4M3, group_rows, group_cols)


@torch.library.triton_op("fxmegatron::fp8_linear_q", mutates_args=())
def fp8_linear_q_op(x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str, tp_group: str, split: str,
                    qx: Tensor, sx: Tensor, qxt: Tensor, sxt: Tensor,
                    qw: Tensor, sw: Tensor, qwt: Tensor, swt: Tensor) -> Tensor:
    """``fp8_linear(x, w, b, ...)`` of a 2-D x from ``fp8_quantize(x)`` and ``fp8_quantize(w)``:
    x and w themselves only give the output its dtype and take the gradients."""
    r = recipe_of(recipe)
    return fp8_gemm(qx, sx, qw.t(), sw.t(), x.dtype, r.fast_accum[0], b)


@torch.library.triton_op("fxmegatron::fp8_linear_q_backward", mutates_args=())
def fp8_linear_q_backward(dy: Tensor, qxt: Tensor, sxt: Tensor, qwt: Tensor, swt: Tensor, recipe: str,
                          tp_group: str, split: str, x_dtype: torch.dtype,
                          w_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    return backward_gemms(dy, qxt, sxt, qwt, swt, recipe_of(recipe), tp_group, split, x_dtype, w_dtype)


def _setup(ctx, inputs, output):
    x, w, b, recipe, tp_group, split = inputs[:6]
    qxt, sxt, qwt, swt = inputs[8], inputs[9], inputs[12], inputs[13]
    # the FP8 copies the backward GEMMs read, not x and w: half of x's bytes, and no second cast
    ctx.save_for_backward(qxt, sxt, qwt, swt)
    ctx.args = (recipe, tp_group, split, x.dtype, w.dtype)
    ctx.bias_dtype = None if b is None else b.dtype


def _autograd_backward(ctx, dy):
    qxt, sxt, qwt, swt = ctx.saved_tensors
    grad_x, grad_w = fp8_linear_q_backward(dy.contiguous(), qxt, sxt, qwt, swt, *ctx.args)
    grad_b = None if ctx.bias_dtype is None else dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.bias_dtype)
    return (grad_x, grad_w, grad_b) + (None,) * 11


fp8_linear_q_op.register_autograd(_autograd_backward, setup_context=_setup)


def fp8_linear_q(x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str, tp_group: str, split: str,
                 qx: Tensor, sx: Tensor, qxt: Tensor, sxt: Tensor,
                 qw: Tensor, sw: Tensor, qwt: Tensor, swt: Tensor) -> Tensor:
    """The graph's call target (a function of this module, as ``ops.fp8.fp8_linear`` is); its
    first six arguments are ``fp8_linear``'s, with x 2-D ([tokens, in])."""
    return fp8_linear_q_op(x, w, b, recipe, tp_group, split, qx, sx, qxt, sxt, qw, sw, qwt, swt)


register(fp8_linear_q, "fp8_amax", "all-reduce(max) of dy's amaxes (backward)", (4,), needs_group=True)


def quantize_operand(x: Tensor, recipe: str, group_rows: str, group_cols: str):
    """The graph's call target for ``fp8_quantize`` (stage folders import it)."""
    return fp8_quantize(x, recipe, group_rows, group_cols)


register(quantize_operand, "fp8_amax", "all-reduce(max) of the operand's amaxes (rows, columns)", (2, 3),
         needs_group=True)
