"""The FP8 quantiser's scale and cast as one Triton kernel, writing one or both layouts.

Eager, a cast is four passes over the operand (to fp32, the product, the clamp, the cast),
a fifth for a transposed operand made row-major, and a dozen small launches for the scale.
Here, given the amax (one, or one per row and one per column), one kernel reads the operand
once through its strides, computes the scale (``max / amax`` in float64 rounded once to fp32,
a power of two below it when asked: ``ops.fp8._inverse_scale``'s arithmetic), and writes
``clamp(x · inv, ±max)`` in FP8 row-major and, when asked, the transposed copy row-major
too: the two layouts a linear's forward and backward GEMMs read (``_scaled_mm`` takes its
left operand row-major and its right one column-major). Rowwise, the copy uses the column
scales: each GEMM quantises along its own contraction dim.

fp32 → FP8 rounds to nearest even on the GPU, as torch's cast does; the values are clamped
first, so saturation never decides. Used on CUDA only (``fxmegatron.ops.fp8``); tests check
the scales in Triton's interpreter and the bytes against the eager cast on a GPU.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.library import wrap_triton

try:
    import triton
    import triton.language as tl
except ImportError:      # the CPU path never launches it
    triton = None

BM, BN, WARPS = 64, 64, 4      # tile rows, columns, warps (benchmarks/fp8_cast_tiles.py measures others)

if triton is not None:
    @triton.jit
    def _inverse(amax, FMAX: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr):
        # max / amax in float64 (a correctly rounded division: div.rn.f64), rounded once to fp32;
        # the fp32 reciprocals below use div_rn, as fp32 "/" may be approximate. The constants are
        # made in float64 here: a float argument is fp32 when launched directly and fp64 from inductor
        fmax = tl.full((), FMAX, tl.float64)
        inv = (fmax / tl.maximum(amax.to(tl.float64), tl.full((), FLOOR, tl.float64))).to(tl.float32)
        if POW2:        # 2^floor(log2(inv)) from the exponent bits (inv is a normal fp32:
            # between 448 / bf16's max and 57344 / 1e-12)
            inv = (inv.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        return inv

    @triton.jit
    def _cast_kernel(x_ptr, amax_ptr, amax_t_ptr, y_ptr, yt_ptr, s_ptr, st_ptr, M, N, sxm, sxn,
                     FMAX: tl.constexpr, FLOOR: tl.constexpr, ROWWISE: tl.constexpr, POW2: tl.constexpr,
                     BOTH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        fmax = tl.full((), FMAX, tl.float32)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        if ROWWISE:
            inv = _inverse(tl.load(amax_ptr + rm, mask=rm < M, other=1.0), FMAX, FLOOR, POW2)
            y = tl.minimum(tl.maximum(x * inv[:, None], -fmax), fmax)
            if pn == 0:
                tl.store(s_ptr + rm, tl.math.div_rn(1.0, inv), mask=rm < M)
        else:
            inv = _inverse(tl.load(amax_ptr), FMAX, FLOOR, POW2)
            y = tl.minimum(tl.maximum(x * inv, -fmax), fmax)
            if (pm == 0) & (pn == 0):
                tl.store(s_ptr, tl.math.div_rn(1.0, inv))
                if BOTH:        # the copy's scale: the same value, its own tensor (op outputs never alias)
                    tl.store(st_ptr, tl.math.div_rn(1.0, inv))
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        if BOTH:
            if ROWWISE:     # the copy is quantised along the other dim: per column of x
                inv_t = _inverse(tl.load(amax_t_ptr + rn, mask=rn < N, other=1.0), FMAX, FLOOR, POW2)
                yt = tl.minimum(tl.maximum(x * inv_t[None, :], -fmax), fmax)
                if pm == 0:
                    tl.store(st_ptr + rn, tl.math.div_rn(1.0, inv_t), mask=rn < N)
            else:
                yt = y
            tl.store(yt_ptr + rn[:, None] * M + rm[None, :], tl.trans(yt).to(yt_ptr.dtype.element_ty),
                     mask=(rn[:, None] < N) & (rm[None, :] < M))


def cast_fp8(x2: Tensor, amax: Tensor, dtype: torch.dtype, pow2: bool, floor: float,
             amax_t: Optional[Tensor] = None, both: bool = False,
             tile: Tuple[int, int, int] = (BM, BN, WARPS)) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """(q, scale, qt, scale_t) of the 2-D ``x2`` (any strides): ``q`` row-major [M, N] FP8 with
    its fp32 dequantisation scale ([] from a scalar ``amax``, [M, 1] from a per-row one), and
    with ``both`` the row-major copy of ``x2ᵀ`` [N, M]: rowwise quantised with the per-column
    ``amax_t`` ([N]; scale [N, 1]), tensorwise with the one scale (``scale_t``: equal, not the same
    tensor). ``tile``: (rows, columns, warps) of a program."""
    m, n = x2.shape
    rowwise = amax.numel() > 1 or amax.dim() == 2
    y = torch.empty((m, n), dtype=dtype, device=x2.device)
    s = torch.empty((m, 1) if rowwise else (), dtype=torch.float32, device=x2.device)
    yt = torch.empty((n, m), dtype=dtype, device=x2.device) if both else y
    st = torch.empty((n, 1) if rowwise else (), dtype=torch.float32, device=x2.device) if both else s
    at = amax_t.contiguous() if (both and rowwise) else amax
    bm, bn, warps = tile
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    # wrap_triton: inside torch.library.triton_op (ops.fp8_operands), torch.compile sees the launch
    wrap_triton(_cast_kernel)[grid](x2, amax.contiguous(), at, y, yt, s, st, m, n, x2.stride(0), x2.stride(1),
                       FMAX=float(torch.finfo(dtype).max), FLOOR=floor, ROWWISE=rowwise, POW2=pow2, BOTH=both,
                       BM=bm, BN=bn, num_warps=warps)
    return (y, s, yt, st) if both else (y, s, None, None)
