"""Host time of the FP8 linear's pieces, one GPU: each piece called N times on tensors small
enough that the GPU waits on the host, so time per call is the host's cost to issue it.

    python benchmarks/fp8_host_overhead.py [--n 300]

Rows: an aten reduction (the amax), the Triton cast launch, ``torch._scaled_mm``, the
``fp8_quantize`` and ``fp8_linear_q`` custom ops (forward, forward + backward), the same
inside a ``torch.compile``d function, and a bf16 ``F.linear`` forward + backward for scale.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxmegatron.kernels.fp8_cast import cast_fp8          # noqa: E402
from fxmegatron.ops.fp8 import AMAX_FLOOR, E4M3, quantize_pair   # noqa: E402
from fxmegatron.ops.fp8_operands import fp8_linear_q, quantize_operand   # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--size", type=int, default=64)
    args = ap.parse_args()
    s = args.size
    dev = "cuda"
    x = torch.randn(s, s, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(s, s, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    amax = torch.linalg.vector_norm(x.detach(), float("inf"))
    q, sc, qt, sct = quantize_pair(x.detach(), "tensorwise", E4M3)

    def linear_q(xx, ww, recipe="tensorwise"):
        qx = quantize_operand(xx.detach(), recipe, "", "")
        qw = quantize_operand(ww.detach(), recipe, "", "")
        return fp8_linear_q(xx, ww, None, recipe, "", "", *qx, *qw)

    compiled = torch.compile(linear_q)
    rows = {
        "vector_norm(inf) (the amax)": lambda: torch.linalg.vector_norm(x.detach(), float("inf")),
        "Triton cast, both layouts": lambda: cast_fp8(x.detach(), amax, E4M3, False, AMAX_FLOOR, both=True),
        "torch._scaled_mm": lambda: torch._scaled_mm(q, q.t(), sc, sct, out_dtype=torch.bfloat16),
        "quantize_pair (python)": lambda: quantize_pair(x.detach(), "tensorwise", E4M3),
        "fp8_quantize op": lambda: quantize_operand(x.detach(), "tensorwise", "", ""),
        "fp8_linear_q forward (2 quantize + linear)": lambda: linear_q(x, w),
        "fp8_linear_q forward + backward": lambda: linear_q(x, w).backward(dy),
        "rowwise forward + backward": lambda: linear_q(x, w, "rowwise").backward(dy),
        "compiled forward + backward": lambda: compiled(x, w).backward(dy),
        "bf16 F.linear forward + backward": lambda: F.linear(x, w).backward(dy),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {s}x{s} operands, {args.n} calls each")
    for name, fn in rows.items():
        print(f"{name:45s} {per_call_us(fn, args.n):8.1f} us/call")


if __name__ == "__main__":
    main()
