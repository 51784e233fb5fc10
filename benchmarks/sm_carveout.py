"""How much a bf16 GEMM slows down beside an NCCL collective, and whether an SM carveout helps.

cuBLAS's Hopper GEMMs are persistent: one CTA per SM walks the tiles. An NCCL kernel holding a
few SMs then leaves a few tiles to a second wave, and the GEMM takes up to twice as long for
a few percent of the GPU. `torch._C._set_sm_carveout_experimental(n)` asks cuBLASLt for a grid
of SMs - n (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`), and NCCL's `max_ctas` keeps the collective
within those n. This measures, on each rank, a GEMM alone and beside a looping all-gather (and
the all-gather's own time), for each (carveout, NCCL max CTAs) pair.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 benchmarks/sm_carveout.py
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def _time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _group(max_ctas: int | None):
    if max_ctas is None:
        return dist.new_group(backend="nccl")
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = max_ctas
    opts.config.min_ctas = 1
    return dist.new_group(backend="nccl", pg_options=opts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--shapes", default="4096x14336,14336x4096,4096x4096")
    ap.add_argument("--gather-mib", type=int, default=256)
    ap.add_argument("--carveouts", default="0,8,16,24")
    ap.add_argument("--max-ctas", default="0,8,16")
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda")
    world = dist.get_world_size()
    chunk = args.gather_mib * 2**20 // 2 // world
    src = torch.randn(chunk, device=dev, dtype=torch.bfloat16)
    dst = torch.empty(chunk * world, device=dev, dtype=torch.bfloat16)
    comm = torch.cuda.Stream()
    rows = []
    for max_ctas in [int(c) for c in args.max_ctas.split(",")]:
        group = _group(max_ctas or None)
        dist.all_gather_into_tensor(dst, src, group=group)
        torch.cuda.synchronize()
        gather_alone = _time(lambda: dist.all_gather_into_tensor(dst, src, group=group), 20)
        for carve in [int(c) for c in args.carveouts.split(",")]:
            torch.backends.cuda.preferred_blas_library("cublaslt" if carve else "cublas")
            torch._C._set_sm_carveout_experimental(carve or None)
            for shape in args.shapes.split(","):
                k, n = (int(v) for v in shape.split("x"))
                a = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
                b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
                alone = _time(lambda: torch.mm(a, b), args.iters)
                dist.barrier(group=group)
                torch.cuda.synchronize()
                with torch.cuda.stream(comm):
                    for _ in range(4 * args.iters):
                        dist.all_gather_into_tensor(dst, src, group=group)
                beside = _time(lambda: torch.mm(a, b), args.iters)
                torch.cuda.synchronize()
                flops = 2 * args.m * k * n
                rows.append((max_ctas, carve, shape, alone, beside, flops, gather_alone))
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library("cublas")
    if rank == 0:
        print("max_ctas carveout shape        alone_ms beside_ms  slowdown  TFLOP/s(alone,beside)  gather_ms")
        for max_ctas, carve, shape, alone, beside, flops, gather in rows:
            print(f"{max_ctas or 'dflt':>8} {carve:>8} {shape:<13} {alone:8.3f} {beside:9.3f} {beside / alone:9.3f}"
                  f"  {flops / alone / 1e9:7.1f} {flops / beside / 1e9:7.1f}  {gather:9.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
