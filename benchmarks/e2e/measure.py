"""Running one layout: build it, warm up, time the steps (a step's time is the slowest
rank's), measure peak memory, profile one more step; every rank learns whether any failed.
Also the rates that follow from a step time and the bf16 matmul that MFU is taken against."""
from __future__ import annotations

import faulthandler
import gc
import sys
import time
import traceback
from dataclasses import asdict

import torch
import torch.distributed as dist

from e2e.builders import BUILDERS
from e2e.master_weights import MasterWeightAdamW, full_tensor
from e2e.profiling import profiled_step, sync


def model_flops(b, s, l, h, v):
    """Model FLOPs of a step (Korthikanti et al. 2022; recomputation not counted)."""
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def rates(step_s, args, cfg, world, peak_tflops):
    """A row's step time and what follows from it: tokens/s, model TFLOP/s per GPU, MFU."""
    tflops = model_flops(args.global_batch, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.vocab_size) \
        / step_s / world / 1e12
    return {"step_ms": step_s * 1e3, "tokens_per_s": args.global_batch * cfg.block_size / step_s,
            "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None}


def merge_rounds(rows, args, cfg, world, peak_tflops):
    """One row from a layout's rounds: the median over all their timed steps, the last round's
    profile, losses and memory; each round's own median in ``step_ms_rounds``."""
    if len(rows) == 1 or any("error" in r for r in rows):
        return next((r for r in rows if "error" in r), rows[-1])
    row = dict(rows[-1])
    steps = sorted(t for r in rows for t in r["step_ms_all"])
    row["step_ms_all"] = steps
    row["step_ms_rounds"] = [r["step_ms"] for r in rows]
    row.update(rates(steps[len(steps) // 2] / 1e3, args, cfg, world, peak_tflops))
    row["peak_gib"] = max((r["peak_gib"] for r in rows if r["peak_gib"] is not None), default=None)
    return row


def run_layout(lay, cfg, args, dev, dtype, ids, labels, meshes, ref_state, peak_tflops, profile=True):
    """Build ``lay``, run --warmup and --steps timed steps (and a profiled one); returns its row."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    job = BUILDERS[lay.kind](lay, cfg, dev, dtype, ids, labels, meshes=meshes, ref_state=ref_state)
    build_s = time.perf_counter() - t0
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    norms = []
    if lay.fadam:
        from fxmegatron.optim import FusedAdamW, clip_coefficient
        opt = FusedAdamW(job.params, lr=args.lr)      # torch.optim.AdamW's defaults otherwise

        def step():
            loss = job.fwd_bwd()
            norms.append(job.norm())
            opt.step(clip_coefficient(norms[-1], 1.0))    # the clip inside the optimizer's pass
            return loss.detach()
    else:
        opt = MasterWeightAdamW(job.params, lr=args.lr, fused=dev.type == "cuda")

        def step():
            loss = job.fwd_bwd()
            norms.append(job.clip())   # the gradient norm before clipping
            opt.step()
            return loss.detach()

    losses = []
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(step())
    sync(dev)
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        sync(dev)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = sorted(slowest.tolist())
    step_s = times[len(times) // 2]

    prof = None
    if profile and not args.no_profile:
        prof = profiled_step(step, lay, args, dev, rank)

    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0],
                        dtype=torch.float64, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    vals = [float(x) for x in losses]
    first_norm = full_tensor(norms[0]).item() if norms else None
    row = {"layout": lay.name, **rates(step_s, args, cfg, world, peak_tflops),
           "peak_gib": peak.item() if dev.type == "cuda" else None,
           "loss_first": vals[0], "loss_last": vals[-1], "losses": vals, "grad_norm_first": first_norm,
           "build_s": build_s, "warmup_s": warmup_s,
           "step_ms_all": [t * 1e3 for t in times], "microbatches": lay.m, "layout_spec": asdict(lay)}
    if prof:
        row.update(prof)
    del job, opt, step, losses, norms
    return row


def run_guarded(lay, cfg, args, dev, dtype, ids, labels, meshes, ref_state, peak_tflops, profile=True):
    """run_layout, with every rank learning whether any rank failed."""
    rank = dist.get_rank()
    row, err, tb = None, None, None
    if args.hang_dump:     # a layout that hangs (in a collective, say) shows where, every rank
        faulthandler.dump_traceback_later(args.hang_dump, exit=False)
    try:
        row = run_layout(lay, cfg, args, dev, dtype, ids, labels, meshes, ref_state, peak_tflops, profile)
    except Exception as exc:    # noqa: BLE001 -- an OOM or a framework error becomes an "error" row
        err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        tb = traceback.format_exc()
        del exc
    finally:
        if args.hang_dump:
            faulthandler.cancel_dump_traceback_later()
    failed = torch.tensor([0.0 if err is None else 1.0], device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        first = next(i for i, e in enumerate(errs) if e is not None)
        if rank == first:
            print(f"[rank {rank}] layout {lay.name} failed:\n{tb}", file=sys.stderr, flush=True)
        row = {"layout": lay.name, "error": f"rank {first}: {errs[first]}"}
        forget_failure(meshes)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def forget_failure(meshes):
    """After a failed layout: sends/receives of the broken step may still be pending in its
    groups, so later layouts get new process groups. (Each pipeline runner reports failures
    under its own store key, so the old failure is not seen again.)"""
    dist.barrier()
    meshes.cache_clear()


def matmul_tflops(dev, n=8192, warmup=5, iters=20):
    """Median bf16 n×n×n matmul throughput on this GPU, TFLOP/s."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ b
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / times[len(times) // 2] / 1e12
