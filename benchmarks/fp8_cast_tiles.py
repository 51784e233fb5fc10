"""The FP8 cast kernel's tile, one GPU: ``kernels/fp8_cast.py`` at each (rows, columns, warps)
tile, on the operand shapes of the end-to-end models, both recipes, both layouts written
(what ``fp8_quantize`` asks for), as effective memory bandwidth: 2 bytes read and 2 written
per element (bf16 in, two FP8 layouts out), GPU time only (calls replayed from a CUDA graph:
timed one by one from Python, the small casts measure the host's launch instead).

    python benchmarks/fp8_cast_tiles.py [--reps 50]
"""
from __future__ import annotations

import argparse
import os
import sys
from statistics import median

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxmegatron.kernels.fp8_cast import BM, BN, WARPS, cast_fp8   # noqa: E402
from fxmegatron.ops.fp8 import AMAX_FLOOR, E4M3                   # noqa: E402

# [tokens, features] activations and gradients of hf-llama1b (8192 tokens), gpt1.3b (16384),
# hf-llama8b (8192); [out, in] weights
SHAPES = [(8192, 2048), (8192, 8192), (16384, 2048), (16384, 8192), (8192, 4096), (8192, 14336),
          (2048, 2048), (14336, 4096)]
TILES = [(BM, BN, WARPS), (64, 64, 8), (128, 64, 4), (128, 64, 8), (64, 128, 4), (64, 128, 8), (128, 128, 8),
         (128, 128, 16), (32, 128, 4), (256, 64, 8)]


def time_us(fn, reps: int, per_graph: int = 10) -> float:
    """GPU time of one call: ``per_graph`` calls captured in a CUDA graph, replayed ``reps``
    times (the host's launch cost, larger than a small cast's, is left out)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_graph)
    return median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_cast_tiles: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GB/s (4 bytes an element), best per row marked *")
    print(f"{'recipe':10s} {'shape':>12s} " + " ".join(f"{'x'.join(map(str, t)):>10s}" for t in TILES))
    totals = {t: 0.0 for t in TILES}
    for rowwise in (False, True):
        for m, n in SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            amax = x.abs().amax(1, keepdim=True).float() if rowwise else x.abs().max().float()
            amax_t = x.abs().amax(0).float() if rowwise else None
            row = {}
            want = cast_fp8(x, amax, E4M3, rowwise, AMAX_FLOOR, amax_t=amax_t, both=True)
            for t in TILES:
                def call():
                    return cast_fp8(x, amax, E4M3, rowwise, AMAX_FLOOR, amax_t=amax_t, both=True, tile=t)
                try:
                    got = call()
                except Exception as exc:          # a tile the compiler cannot fit
                    print(f"  tile {t}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                    row[t], totals[t] = 0.0, float("inf")
                    continue
                # every tile must write the same bytes and scales as the default one
                assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                       b.view(torch.uint8) if b.element_size() == 1 else b) for a, b in zip(got, want)), t
                us = time_us(call, args.reps)
                row[t] = 4 * m * n / us / 1e3
                totals[t] += us
            best = max(row, key=row.get)
            print(f"{'rowwise' if rowwise else 'tensorwise':10s} {f'{m}x{n}':>12s} "
                  + " ".join(f"{row[t]:9.0f}{'*' if t == best else ' '}" for t in TILES))
    print("total us  " + " " * 13 + " ".join(f"{totals[t]:10.0f}" for t in TILES))


if __name__ == "__main__":
    main()
