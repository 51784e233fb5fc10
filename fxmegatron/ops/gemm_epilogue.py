"""A linear followed by a tanh GeLU as one op whose GEMM computes the GeLU in its epilogue.

``linear_gelu(x, w, b)`` = ``gelu(linear(x, w, b), approximate="tanh")``. On CUDA in
bf16/fp16 the forward is one cuBLASLt GEMM with the ``GELU_AUX_BIAS`` epilogue
(``kernels.cublaslt``): it writes the activation and the pre-activation (which the backward
needs) in one pass, where ATen and inductor write the pre-activation and run a GeLU kernel
that reads it back and writes the activation. Elsewhere (CPU, fp32, fp64, or a shape cuBLASLt
has no algorithm for) the forward is the two ATen ops.

The backward is autograd's formulas for the two: the GeLU derivative (in the sigmoid form of
``passes/gelu_for_inductor.py``: inductor's and ATen's tanh is bound by its instructions) and
the bias gradient's sum in one pass on CUDA (``kernels.gelu_backward``; ATen ops elsewhere),
then the linear's two GEMMs as ATen ``mm``s.
cuBLASLt's ``DGELU``, ``DGELU_BGRAD`` and ``BGRADB`` epilogues do the same work in a separate
kernel after the GEMM on Hopper, so they are not used. ``benchmarks/gemm_epilogues.py
--dgelu``, gpt1.3b's second MLP GEMM's input gradient on an H100: the GEMM then
``kernels.gelu_backward`` 1.03 ms, ``DGELU`` and a column sum 1.94 ms, ``DGELU_BGRAD`` 1.83 ms
(its epilogue kernel alone 1.14 ms).

The op keeps x and the pre-activation, as the linear and the GeLU do (the next linear keeps
the activation). The epilogue applies the GeLU to the pre-activation before its rounding to
bf16, where ATen rounds it first: a last-bit difference in bf16.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fxmegatron.kernels import cublaslt
from fxmegatron.kernels.gelu_backward import gelu_tanh_backward_bias

EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)
TWO_SQRT_2_OVER_PI = 2 * math.sqrt(2 / math.pi)      # the tanh GeLU is x·σ(x·(C1 + C3·x²))
CUBIC = TWO_SQRT_2_OVER_PI * 0.044715


def _fast(t: Tensor) -> bool:
    return t.is_cuda and t.dtype in EPILOGUE_DTYPES and cublaslt.available()


def _forward(x: Tensor, w: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    x2 = x.reshape(-1, x.shape[-1])
    act = None
    if _fast(x2):
        pre = torch.empty(x2.shape[0], w.shape[0], dtype=x2.dtype, device=x2.device)
        act = cublaslt.mm(x2, w.t(), "gelu_aux_bias", bias=b, aux=pre)
    if act is None:
        pre = F.linear(x2, w, b)
        act = F.gelu(pre, approximate="tanh")
    return act.view(*x.shape[:-1], w.shape[0]), pre


def gelu_tanh_backward(dy: Tensor, x: Tensor) -> Tensor:
    """d gelu(x, "tanh") · dy, in the sigmoid form: gelu = x·σ(z), z = x·(C1 + C3·x²), so
    gelu' = σ + x·σ·(1 − σ)·(C1 + 3·C3·x²); in fp32 (fp64 stays), rounded once."""
    dtype = dy.dtype
    up = torch.promote_types(dtype, torch.float32)
    xf = x.to(up)
    x2 = xf * xf
    s = torch.sigmoid(xf * (TWO_SQRT_2_OVER_PI + CUBIC * x2))
    d = s + xf * s * (1 - s) * (TWO_SQRT_2_OVER_PI + 3 * CUBIC * x2)
    return (dy.to(up) * d).to(dtype)


@torch.library.custom_op("fxmegatron::gelu_backward_bias", mutates_args=())
def gelu_backward_bias(dact: Tensor, pre: Tensor) -> Tuple[Tensor, Tensor]:
    """(dpre, db): the tanh GeLU's input gradient and its sum over rows, for 2-D dact, pre."""
    if pre.is_cuda:
        return gelu_tanh_backward_bias(dact.contiguous(), pre.contiguous(), TWO_SQRT_2_OVER_PI, CUBIC)
    # dense, as the fake says (an elementwise result would take a transposed input's layout)
    dpre = gelu_tanh_backward(dact, pre).contiguous()
    return dpre, dpre.sum(0)


@gelu_backward_bias.register_fake
def _(dact, pre):
    return pre.new_empty(pre.shape), pre.new_empty(pre.shape[1])


@torch.library.custom_op("fxmegatron::linear_gelu", mutates_args=())
def linear_gelu_op(x: Tensor, w: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    return _forward(x, w, b)


@linear_gelu_op.register_fake
def _(x, w, b):
    rows = x.numel() // x.shape[-1]
    return x.new_empty((*x.shape[:-1], w.shape[0])), x.new_empty((rows, w.shape[0]))


def _setup(ctx, inputs, output):
    x, w, _b = inputs
    ctx.save_for_backward(x, output[1], w)
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, dact, _dpre):
    x, pre, w = ctx.saved_tensors
    if dact is None:
        return None, None, None
    dpre, db = gelu_backward_bias(dact.reshape(pre.shape), pre)
    x2 = x.reshape(-1, x.shape[-1])
    if w.stride(0) == 1 and w.stride(1) != 1:
        # w is a [k, n] weight's transposed view (GPT-2's Conv1D): its gradient made [k, n]
        # contiguous, so that the view's backward hands the parameter a gradient of its own
        # layout (autograd would otherwise copy it into one: 1 ms a step at GPT-2 XL's widths)
        dw = x2.t().mm(dpre).t()
    else:
        dw = dpre.t().mm(x2)
    return dpre.mm(w).view(x.shape), dw, db


linear_gelu_op.register_autograd(_autograd_backward, setup_context=_setup)


def linear_gelu(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``gelu(linear(x, w, b), approximate="tanh")``; the graph's call target."""
    return linear_gelu_op(x, w, b)[0]
