"""A float64 reference of the FP8 recipes (``fxmegatron.ops.fp8``), written from the recipe
table alone: quantisation as "scale, round to the FP8 grid" with the grid computed here, and
each GEMM's operands quantised along the axes and in the dtypes the table gives. Used by
tests/test_fp8.py and tests/test_fp8_pass.py."""
import copy

import torch
import torch.nn as nn

from fxmegatron.ops.fp8 import E4M3, E5M2, RECIPES

RECIPE_NAMES = sorted(RECIPES)
GRID = {E4M3: (3, -6), E5M2: (2, -14)}     # mantissa bits, exponent of the smallest normal


def to_grid(y, dtype):
    """``y`` (float64) rounded to the nearest value of the FP8 format, ties to even, saturating."""
    mant, emin = GRID[dtype]
    m = torch.finfo(dtype).max
    y = y.clamp(-m, m)
    _, ex = torch.frexp(y.abs().clamp(min=2.0 ** emin))       # |y| in [2^(ex-1), 2^ex); subnormals: emin's step
    step = torch.ldexp(torch.ones_like(y), ex - 1 - mant)
    return torch.round(y / step) * step


def ref_quantize(x, rowwise, dtype, pow2):
    """(FP8 values, dequantisation scale) in float64, per row of the 2-D view or per tensor:
    max/amax rounded once to fp32 (a power of two at most that with ``pow2``), x times that as
    fp32 computes it (the exact product rounded once), then the grid."""
    x = x.double().reshape(-1, x.shape[-1])
    amax = x.abs().amax(1, keepdim=True) if rowwise else x.abs().amax()
    inv = (torch.finfo(dtype).max / amax.clamp(min=1e-12)).float().double()
    if pow2:
        inv = torch.ldexp(torch.ones_like(inv), torch.frexp(inv)[1] - 1)
    return to_grid((x * inv).float().double(), dtype), (1 / inv).float().double()


def ref_operands(x, w, dy, rowwise=True, grad_dtype=E4M3, pow2=True, grad_w_axes="columns"):
    """The dequantised float64 operands (a, b) of out = a @ b, grad_x, grad_w, as the table
    says; the keyword arguments describe a recipe (or misreadings of it)."""
    def q(t, dtype):
        v, s = ref_quantize(t, rowwise, dtype, pow2)
        return v * s
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if grad_w_axes == "columns":
        gw = (q(dy2.t(), grad_dtype), q(x2.t(), E4M3).t())
    else:   # the forward's per-row quantisations reused
        gw = (q(dy2, grad_dtype).t(), q(x2, E4M3))
    return [(q(x2, E4M3), q(w, E4M3).t()), (q(dy2, grad_dtype), q(w.t(), E4M3).t()), gw]


def recipe_kwargs(recipe):
    r = RECIPES[recipe]
    return dict(rowwise=r.rowwise, grad_dtype=r.grad_dtype, pow2=r.pow2_scales)


def within_fp32_sum(got, a, b, extra=None):
    """|got - a @ b| within the bound of summing the (exact) products in fp32 and rounding the
    scaled result (and a bias) once more."""
    exact = a @ b + (0 if extra is None else extra.double())
    bound = (a.shape[1] + 4) * 2.0 ** -24 * (a.abs() @ b.abs()) + 2.0 ** -23 * exact.abs() + 1e-30
    return bool(((got.double().reshape(exact.shape) - exact).abs() <= bound).all())


def wide(*shape, seed=0, spread=4.0):
    """Random values whose rows and columns span many binades (tensorwise and per-axis scales,
    and the two axes of rowwise scaling, then quantise differently)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.exp2(spread * torch.randn(shape[0], 1, generator=g))
            * torch.exp2(spread * torch.randn(1, shape[1], generator=g)))


class RefFP8Linear(torch.autograd.Function):
    """The recipe written out by hand in float64 from the reference quantiser."""

    @staticmethod
    def forward(ctx, x, w, b, recipe):
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.has_b = recipe, b is not None
        (a, bb), = ref_operands(x, w, torch.zeros(1, w.shape[0]), **recipe_kwargs(recipe))[:1]
        out = a @ bb + (0 if b is None else b.double())
        return out.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        _, (a1, b1), (a2, b2) = ref_operands(x, w, dy, **recipe_kwargs(ctx.recipe))
        gb = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_b else None
        return (a1 @ b1).reshape(x.shape).to(x.dtype), (a2 @ b2).to(w.dtype), gb, None


def hand_fp8(model, recipe):
    """``model`` with its block linears (not the LM head) replaced by ``RefFP8Linear``."""
    model = copy.deepcopy(model)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            m.forward = lambda x, m=m: RefFP8Linear.apply(x, m.weight, m.bias, recipe)
    return model
