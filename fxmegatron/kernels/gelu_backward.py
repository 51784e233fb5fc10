"""The tanh GeLU's backward and its bias gradient in one pass: dpre = dact · gelu'(pre) and
db = Σ dpre over rows, for [T, N] row-major dact and pre.

Inductor writes dpre in one kernel and reads it back for the column sum in another (a
reduction across rows does not fuse with the pointwise kernel that feeds it): 0.26 + 0.09 ms
at gpt1.3b's [16384, 8192] on an H100 (``benchmarks/gemm_epilogues.py``). Here each program
walks ``ROWS`` rows of a ``BN``-column strip, writes dpre and keeps the strip's sums in fp32
registers; a [T / ROWS, N] fp32 table of partial sums is summed once more after. The
derivative is the sigmoid form (``ops.gemm_epilogue.gelu_tanh_backward``), in fp32, rounded
once to dpre's dtype, and the sums add the unrounded fp32 values.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:      # the CPU path never launches it
    triton = None

ROWS, BT, BN, WARPS = 128, 4, 1024, 4     # benchmarks/gemm_epilogues.py --tiles (H200: 0.219 ms, inductor 0.257)

if triton is not None:
    @triton.jit
    def _gelu_backward_bias(dact_ptr, pre_ptr, dpre_ptr, part_ptr, T, N, C1: tl.constexpr, C3: tl.constexpr,
                            ROWS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
        strip = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        for start in range(0, ROWS, BT):
            rows = strip.to(tl.int64) * ROWS + start + tl.arange(0, BT)
            mask = (rows < T)[:, None] & cmask[None, :]
            offs = rows[:, None] * N + cols[None, :]
            x = tl.load(pre_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dact_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = x * x
            s = tl.sigmoid(x * (C1 + C3 * x2))
            d = dy * (s + x * s * (1.0 - s) * (C1 + 3.0 * C3 * x2))
            tl.store(dpre_ptr + offs, d.to(dpre_ptr.dtype.element_ty), mask=mask)
            acc += tl.sum(d, axis=0)
        tl.store(part_ptr + strip * N + cols, acc, mask=cmask)


def gelu_tanh_backward_bias(dact: Tensor, pre: Tensor, c1: float, c3: float,
                            tiles=None) -> Tuple[Tensor, Tensor]:
    """(dpre, db) for contiguous 2-D dact and pre of one shape and dtype. ``tiles``: (ROWS, BT,
    BN, WARPS) instead of the module's (``benchmarks/gemm_epilogues.py --tiles`` measures them)."""
    rows_, bt, bn, warps = tiles or (ROWS, BT, BN, WARPS)
    t, n = pre.shape
    dpre = torch.empty_like(pre)
    strips = triton.cdiv(t, rows_)
    part = torch.empty(strips, n, dtype=torch.float32, device=pre.device)
    _gelu_backward_bias[(strips, triton.cdiv(n, bn))](dact, pre, dpre, part, t, n, C1=c1, C3=c3, ROWS=rows_, BT=bt,
                                                      BN=bn, num_warps=warps)
    return dpre, part.sum(0).to(pre.dtype)
