"""FP8 matmuls of linear layers with dynamic scaling: ``fp8_linear`` and its quantiser.

The recipes are torchao's float8 training recipes (``torchao.float8.config``,
``Float8LinearConfig.from_recipe_name``). Each linear runs three GEMMs; each operand is
cast to FP8 with a scale computed from its own amax just before the GEMM (dynamic
scaling; weights keep their bf16/fp32 masters, the optimiser never sees FP8):

================  ======================  =====================  ===========  ==============
GEMM              left operand            right operand          tensorwise   rowwise
================  ======================  =====================  ===========  ==============
out    = x @ wᵀ   x      e4m3             wᵀ     e4m3            fast accum   fast accum
grad_x = dy @ w   dy     e5m2 | e4m3      w      e4m3            exact accum  exact accum
grad_w = dyᵀ @ x  dyᵀ    e5m2 | e4m3      x      e4m3            exact accum  exact accum
================  ======================  =====================  ===========  ==============

* ``tensorwise``: one scale per tensor; the output gradient ``dy`` in e5m2 (range over
  precision: gradients span more binades than activations), the rest in e4m3.
* ``rowwise``: one scale per row of the left operand and per column of the right one, i.e.
  along each GEMM's contraction dim, so ``x``, ``w`` and ``dy`` are each quantised twice,
  along different axes; e4m3 everywhere, gradients included (torchao's rowwise recipe: each
  row has its own range), and scales rounded up to a power of two (exact to apply, and a
  value quantises alike in forward and backward).
* "fast accum" is ``torch._scaled_mm(use_fast_accum=True)`` on the GPU (torchao's default:
  the output GEMM only); the emulation always sums in fp32. The bias gradient is ``dy``
  summed, not quantised. Backward quantises x and w again from the high-precision tensors
  the op saves (as a linear saves them), amaxes (and their reductions) included.

A scale is the dequantisation factor ``amax / finfo(dtype).max`` that ``_scaled_mm`` takes;
it is computed as torchao does, as the reciprocal of ``max / amax`` rounded once to fp32
from float64 (so that eager and compiled code agree to the bit).

Tensor parallelism. When ``tp_group`` is not empty, every amax is the max over the group,
except a per-row amax whose rows are different rows on different ranks (``split`` names the
GEMM dim the ranks hold different slices of: "out" for a column-parallel linear, "in" for a
row-parallel one, "tokens" for sequence shards). Then every operand quantises exactly as in
the unsplit matmul: an element's FP8 value depends only on the element and its scale, and
its scale is the amax over the same set of elements as without tp. A tensorwise amax of a
shard, max-reduced, is the whole tensor's. A per-row amax is taken along the GEMM's
contraction dim: where that dim is the one split (x and w of a row-parallel forward, dy and
w of a column-parallel grad_x), each rank holds part of every row and the max over ranks is
the whole row's; where the rows themselves are split (w of a column-parallel forward), each
rank holds whole rows, different ones, and their local amax is already exact (reducing would
mix different rows). A replicated operand reduces to itself. The product of two identically
quantised shards is then the unsplit product's slice or partial sum, up to fp32 summation
order, like any tp matmul. (With power-of-two scales, FP8 rounding does not depend on the
scale except near the bottom of the range, subnormals and flushes to zero: a missing
reduction there hides from model-level comparisons; tests/test_fp8.py checks the operands.)

On CUDA (sm_89+) the GEMMs are ``torch._scaled_mm``; elsewhere they are emulated: the same
FP8 casts (torch casts to ``float8_e4m3fn``/``float8_e5m2`` on any device), the products
summed in fp32 and scaled, the bias added in fp32 before the one rounding to the output
dtype, as the GPU epilogue does.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from fxmegatron.errors import PrecisionError
from fxmegatron.kernels.fp8_cast import cast_fp8
from fxmegatron.ops.collectives import all_reduce
from fxmegatron.ops.registry import register

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# an all-zero tensor (or row: padding tokens, a gradient that is zero) has amax 0: the floor
# keeps max / amax finite, so zeros quantise to zeros instead of 0 * inf = NaN (torchao's EPS)
AMAX_FLOOR = 1e-12
SPLITS = ("", "out", "in", "tokens")


@dataclass(frozen=True)
class Recipe:
    name: str
    rowwise: bool
    grad_dtype: torch.dtype                      # dy's FP8 dtype, in both backward GEMMs
    pow2_scales: bool
    fast_accum: Tuple[bool, bool, bool] = (True, False, False)   # out, grad_x, grad_w


RECIPES = {
    "tensorwise": Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, pow2_scales=False),
    "rowwise": Recipe("rowwise", rowwise=True, grad_dtype=E4M3, pow2_scales=True),
}


def recipe_of(recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise PrecisionError(f"fp8 recipe={recipe!r}: expected one of {sorted(RECIPES)}")
    return RECIPES[recipe]


def check_fp8_device(device) -> None:
    """Refuse a CUDA GPU without FP8 tensor cores (``_scaled_mm`` needs sm_89+: Ada, Hopper
    and later); other devices run the emulation."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        why = _no_fp8(device.index if device.index is not None else torch.cuda.current_device())
        if why:
            raise PrecisionError(why)


@functools.lru_cache(maxsize=None)
def _no_fp8(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) >= (8, 9):
        return ""
    return (f"FP8 matmuls need an sm_89+ GPU (Ada, Hopper: H100, H200, or later); this GPU "
            f"({torch.cuda.get_device_name(index)}) is sm_{major}{minor}: use the default precision (bf16)")


def _inverse_scale(amax: Tensor, dtype: torch.dtype, pow2: bool) -> Tensor:
    """max / amax (the factor that maps amax onto the format's largest value), in fp32."""
    inv = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    # rounding max/amax down to a power of two rounds the scale up: nothing leaves the range
    return torch.exp2(torch.floor(torch.log2(inv))) if pow2 else inv


def saturate(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast to FP8, clamping to ±max first: a plain cast is not saturating (e5m2 overflows to
    inf; e4m3fn, which has no inf, to NaN on devices and versions that do not clamp)."""
    m = torch.finfo(dtype).max
    return x.clamp(-m, m).to(dtype)


def quantize(x: Tensor, recipe, dtype: torch.dtype = E4M3, group_name: str = "") -> Tuple[Tensor, Tensor]:
    """(x in FP8, dequantisation scale) of the 2-D view ``x.reshape(-1, x.shape[-1])``; the FP8
    tensor is row-major. Tensorwise: a scalar scale; rowwise: one per row, shape [M, 1] (for
    per-column scales quantise ``x.t()``). ``group_name``: the amax is the max over that group."""
    r = recipe_of(recipe)
    x2 = x.reshape(-1, x.shape[-1])
    amax = _amax(x2, 1 if r.rowwise else None, group_name)
    if x2.is_cuda:       # one pass, read through x2's strides, written row-major, the scale computed in it
        return cast_fp8(x2, amax, dtype, r.pow2_scales, AMAX_FLOOR)[:2]
    return _emulated_cast(x2, amax, dtype, r.pow2_scales)


def quantize_pair(x: Tensor, recipe, dtype: torch.dtype, group_rows: str = "",
                  group_cols: str = "") -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``quantize(x2)`` and ``quantize(x2.t())`` of ``x2 = x.reshape(-1, x.shape[-1])``, the two
    layouts a linear's GEMMs read of one operand, with the same bytes and scales as those two
    calls. On CUDA both come from one read of x (the amaxes aside). ``group_rows`` /
    ``group_cols``: the groups the amaxes of x2's rows / of its columns are max-reduced over
    (tensorwise: one amax, ``group_rows``'s)."""
    r = recipe_of(recipe)
    x2 = x.reshape(-1, x.shape[-1])
    if not r.rowwise:
        amax = _amax(x2, None, group_rows)
        if x2.is_cuda:
            return cast_fp8(x2, amax, dtype, r.pow2_scales, AMAX_FLOOR, both=True)
        q, s = _emulated_cast(x2, amax, dtype, r.pow2_scales)
        return q, s, q.t().contiguous(), s.clone()     # one scale: the same FP8 values, transposed
    amax_r, amax_c = _amax(x2, 1, group_rows), _amax(x2.t(), 1, group_cols)
    if x2.is_cuda:
        return cast_fp8(x2, amax_r, dtype, r.pow2_scales, AMAX_FLOOR, amax_t=amax_c.view(-1), both=True)
    return (*_emulated_cast(x2, amax_r, dtype, r.pow2_scales), *_emulated_cast(x2.t(), amax_c, dtype, r.pow2_scales))


def _amax(x2: Tensor, dim: Optional[int], group_name: str) -> Tensor:
    """The largest |x| (per row with ``dim=1``, [M, 1]) in one pass (no |x| tensor): exact in any
    dtype, a max rounds nothing; max-reduced over ``group_name``."""
    amax = torch.linalg.vector_norm(x2, float("inf"), dim=dim, keepdim=dim is not None)
    return all_reduce(amax.float(), "max", group_name) if group_name else amax


def _emulated_cast(x2: Tensor, amax: Tensor, dtype: torch.dtype, pow2: bool) -> Tuple[Tensor, Tensor]:
    inv = _inverse_scale(amax.float(), dtype, pow2)
    return saturate(x2.float() * inv, dtype).contiguous(), inv.reciprocal()


def amax_group(r: Recipe, group: str, split: str, rows: str) -> str:
    """The group to max-reduce an amax over (see the module docstring): all of them, but a
    per-row amax whose rows (``rows``: which GEMM dim they index) are split over the ranks."""
    return "" if r.rowwise and rows == split else group


def scaled_mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype, fast_accum: bool,
              bias: Optional[Tensor] = None, shape=None) -> Tensor:
    """(a @ b) * sa * sb (+ bias) in ``out_dtype`` by ``torch._scaled_mm``: ``a`` [M, K] row-major
    FP8 with scale [] or [M, 1], ``b`` [K, N] column-major FP8 with scale [] or [1, N] (fp32
    dequantisation scales). Its fused bias must have the output's dtype, bf16 or fp16. The
    result has ``shape`` (M·N elements; default [M, N])."""
    fused = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    if shape is None:       # 2-D: the GEMM's own result (traced by torch.compile: no out= copy)
        res = torch._scaled_mm(a, b, sa, sb, bias=bias if fused else None,
                               out_dtype=out_dtype if fused or bias is None else torch.float32,
                               use_fast_accum=fast_accum)
        return res if fused or bias is None else (res + bias.float()).to(out_dtype)
    shape = tuple(shape)
    # written through a 2-D view of a tensor of the output's shape: an op's output must not be a
    # view (autograd forbids in-place ops on views made inside a custom Function; models do them)
    res = torch.empty(shape, dtype=out_dtype if fused or bias is None else torch.float32, device=a.device)
    torch._scaled_mm(a, b, sa, sb, bias=bias if fused else None, out_dtype=res.dtype, use_fast_accum=fast_accum,
                     out=res.view(-1, shape[-1]))
    return res if fused or bias is None else (res + bias.float()).to(out_dtype)


def emulated_mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
                bias: Optional[Tensor] = None, shape=None) -> Tensor:
    """``scaled_mm`` on any device: the FP8 values (exact in fp32, as are their products)
    summed in fp32, then scaled, the bias added and rounded once, as the GPU's epilogue does.
    (Hopper's fast accumulation, in fewer bits, is not emulated.)"""
    lead = tuple(shape or (a.shape[0], b.shape[1]))[:-1]
    # matmul of the input viewed in the output's leading dims: the result is no view (see scaled_mm)
    out = (a.float().view(*lead, a.shape[1]) @ b.float()) * (sa.view(*lead, 1) if sa.dim() else sa) * sb
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_gemm(a, sa, b, sb, out_dtype, fast_accum, bias=None, shape=None) -> Tensor:
    """``scaled_mm`` on CUDA (refusing a GPU without FP8), ``emulated_mm`` elsewhere."""
    if a.is_cuda:
        check_fp8_device(a.device)
        return scaled_mm(a, sa, b, sb, out_dtype, fast_accum, bias, shape)
    return emulated_mm(a, sa, b, sb, out_dtype, fast_accum, bias, shape)


def _forward(x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str, group: str, split: str) -> Tensor:
    r = recipe_of(recipe)
    qx, sx = quantize(x, r, E4M3, amax_group(r, group, split, "tokens"))
    qw, sw = quantize(w, r, E4M3, amax_group(r, group, split, "out"))
    return fp8_gemm(qx, sx, qw.t(), sw.t(), x.dtype, r.fast_accum[0], b, (*x.shape[:-1], w.shape[0]))


def _backward(dy: Tensor, x: Tensor, w: Tensor, recipe: str, group: str, split: str) -> Tuple[Tensor, Tensor]:
    r = recipe_of(recipe)
    x2 = x.reshape(-1, x.shape[-1])
    qxt, sxt = quantize(x2.t(), r, E4M3, amax_group(r, group, split, "in"))
    qwt, swt = quantize(w.t(), r, E4M3, amax_group(r, group, split, "in"))
    return backward_gemms(dy, qxt, sxt, qwt, swt, r, group, split, x.dtype, w.dtype)


def backward_gemms(dy: Tensor, qxt: Tensor, sxt: Tensor, qwt: Tensor, swt: Tensor, r: Recipe, group: str,
                   split: str, x_dtype: torch.dtype, w_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(grad_x, grad_w) from dy and the FP8 copies of xᵀ ([in, tokens]) and wᵀ ([in, out]),
    row-major, quantised along tokens and out features."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    # grad_x = dy @ w: dy per row (token), w per column (in feature), both along out features;
    # grad_w = dyᵀ @ x: dyᵀ per row (out feature), x per column (in feature), both along tokens
    qdy, sdy, qdyt, sdyt = quantize_pair(dy2, r, r.grad_dtype, amax_group(r, group, split, "tokens"),
                                         amax_group(r, group, split, "out"))
    grad_x = fp8_gemm(qdy, sdy, qwt.t(), swt.t(), x_dtype, r.fast_accum[1],
                          shape=None if dy.dim() == 2 else (*dy.shape[:-1], qwt.shape[0]))
    grad_w = fp8_gemm(qdyt, sdyt, qxt.t(), sxt.t(), w_dtype, r.fast_accum[2])
    return grad_x, grad_w


def _check(x: Tensor, w: Tensor, recipe: str, split: str) -> None:
    recipe_of(recipe)
    if split not in SPLITS:
        raise ValueError(f"fp8_linear(split={split!r}): expected one of {SPLITS}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_linear: input {tuple(x.shape)} and weight {tuple(w.shape)} do not make a linear")


@torch.library.custom_op("fxmegatron::fp8_linear", mutates_args=())
def fp8_linear_op(x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str, tp_group: str, split: str) -> Tensor:
    _check(x, w, recipe, split)
    return _forward(x, w, b, recipe, tp_group, split)


@fp8_linear_op.register_fake
def _(x, w, b, recipe, tp_group, split):
    _check(x, w, recipe, split)
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("fxmegatron::fp8_linear_backward", mutates_args=())
def fp8_linear_backward(dy: Tensor, x: Tensor, w: Tensor, recipe: str, tp_group: str,
                        split: str) -> Tuple[Tensor, Tensor]:
    return _backward(dy, x, w, recipe, tp_group, split)


@fp8_linear_backward.register_fake
def _(dy, x, w, recipe, tp_group, split):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    x, w, b = inputs[:3]
    # the high-precision x and w, as a linear keeps them: backward quantises them along other axes
    ctx.save_for_backward(x, w)
    ctx.args = inputs[3:]
    ctx.bias_dtype = None if b is None else b.dtype


def _autograd_backward(ctx, dy):
    x, w = ctx.saved_tensors
    grad_x, grad_w = fp8_linear_backward(dy.contiguous(), x, w, *ctx.args)
    grad_b = None if ctx.bias_dtype is None else dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b, None, None, None


fp8_linear_op.register_autograd(_autograd_backward, setup_context=_setup)


def fp8_linear(x: Tensor, w: Tensor, b: Optional[Tensor], recipe: str, tp_group: str, split: str = "") -> Tensor:
    """``linear(x, w, b)`` with FP8 GEMMs (forward and backward) as ``recipe`` says; the graph's
    call target (a function of this module, so that stage folders import it and symbolise its
    group name). ``tp_group``: the tensor-parallel group whose ranks hold shards of this linear
    ("" for none); ``split``: which dim they split ("out", "in", "tokens" or "")."""
    return fp8_linear_op(x, w, b, recipe, tp_group, split)


# amaxes: a scalar per tensor, or a vector per row; over no group ("") nothing is communicated
register(fp8_linear, "fp8_amax", "all-reduce(max) of the amaxes of x and w (forward), of dy, w and x (backward)",
         (4,), needs_group=True)
