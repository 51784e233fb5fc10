"""The FP8 quantiser's cast as one Triton kernel: ``clamp(x · inv, ±max)`` rounded to FP8.

Eager, ``quantize``'s cast is four passes over the operand (to fp32, the product, the clamp,
the cast) and a fifth for a transposed operand made row-major; here it is one: the operand is
read through its strides (a weight read as ``w.t()`` included) and written row-major in FP8.
The scale is one value (tensorwise) or one per row (rowwise). fp32 → FP8 rounds to nearest
even on the GPU, as torch's cast does; the values are clamped first, so saturation never
decides. Used on CUDA only (``fxmegatron.ops.fp8``); tests compare its bytes with the eager
cast on a GPU.
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:      # the CPU path never launches it
    triton = None

BM, BN = 64, 64

if triton is not None:
    @triton.jit
    def _cast_kernel(x_ptr, inv_ptr, y_ptr, M, N, sxm, sxn, fmax,
                     ROWWISE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        if ROWWISE:
            inv = tl.load(inv_ptr + rm, mask=rm < M, other=1.0)[:, None]
        else:
            inv = tl.load(inv_ptr)
        y = tl.minimum(tl.maximum(x * inv, -fmax), fmax)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scaled_cast_kernel(x_ptr, amax_ptr, y_ptr, scale_ptr, M, N, sxm, sxn, fmax, floor,
                            ROWWISE: tl.constexpr, POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0).to(tl.float32)
        if ROWWISE:
            amax = tl.load(amax_ptr + rm, mask=rm < M, other=1.0).to(tl.float64)
        else:
            amax = tl.load(amax_ptr).to(tl.float64)
        # ops.fp8._inverse_scale: max / amax in float64, rounded once to fp32
        inv = (tl.cast(fmax, tl.float64) / tl.maximum(amax, floor)).to(tl.float32)     # fp64: IEEE division
        if POW2:        # 2^floor(log2(inv)) from the exponent bits (inv is normal: >= 1 / 2^-126)
            bits = inv.to(tl.int32, bitcast=True) & 0x7F800000
            inv = bits.to(tl.float32, bitcast=True)
        if ROWWISE:
            y = tl.minimum(tl.maximum(x * inv[:, None], -fmax), fmax)
            if tl.program_id(1) == 0:
                tl.store(scale_ptr + rm, 1.0 / inv, mask=rm < M)
        else:
            y = tl.minimum(tl.maximum(x * inv, -fmax), fmax)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(scale_ptr, 1.0 / inv)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def cast_fp8(x2: Tensor, inv: Tensor, dtype: torch.dtype) -> Tensor:
    """Row-major FP8 ``clamp(x2 · inv, ±max)`` of the 2-D ``x2`` (any strides) with ``inv`` a
    scalar or one value per row ([M, 1]), fp32."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=dtype, device=x2.device)
    inv = inv.float().contiguous()
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    _cast_kernel[grid](x2, inv, y, m, n, x2.stride(0), x2.stride(1), float(torch.finfo(dtype).max),
                       ROWWISE=inv.numel() > 1 or inv.dim() == 2, BM=BM, BN=BN, num_warps=4)
    return y


def scaled_cast_fp8(x2: Tensor, amax: Tensor, dtype: torch.dtype, pow2: bool, floor: float):
    """(row-major FP8 of ``x2``, fp32 dequantisation scale) from the amax (a scalar, or [M, 1]
    per row): the scale computed in the cast kernel itself, as ``ops.fp8._inverse_scale``
    does on the host (max / amax in float64 rounded to fp32; a power of two below it when
    ``pow2``), one launch instead of a dozen small ones."""
    m, n = x2.shape
    rowwise = amax.dim() == 2
    y = torch.empty((m, n), dtype=dtype, device=x2.device)
    scale = torch.empty((m, 1) if rowwise else (), dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    _scaled_cast_kernel[grid](x2, amax.contiguous(), y, scale, m, n, x2.stride(0), x2.stride(1),
                              float(torch.finfo(dtype).max), floor, ROWWISE=rowwise, POW2=pow2, BM=BM, BN=BN,
                              num_warps=4)
    return y, scale
