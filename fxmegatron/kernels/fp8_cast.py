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
