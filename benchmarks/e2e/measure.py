"""Running one layout: build it, warm up, time the steps (a step's time is the slowest
rank's) and each step's model and optimizer phases apart, measure peak memory, profile one
more step, count what torch.compile did meanwhile (e2e/compile_stats.py); every rank learns
whether any failed. Also the rates that follow from a step time
and the bf16 matmul that MFU is taken against."""
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
from e2e.compile_stats import CompileStats, over_ranks
from e2e.master_weights import full_tensor
from e2e.optimizers import OPTIMIZERS, make_optimizer
from e2e.profiling import profiled_step, sync


def gpt_flops(b, s, l, h, v):
    """The bundled GPT's model FLOPs of a step in Korthikanti et al.'s closed form (the formula
    this benchmark used before ``ModelSpec.flops``, which equals it for GPT)."""
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def rates(step_s, spec, world, peak_tflops):
    """A row's step time and what follows from it: tokens/s, model TFLOP/s per GPU, MFU."""
    tflops = spec.flops() / step_s / world / 1e12
    return {"step_ms": step_s * 1e3, "tokens_per_s": spec.batch * spec.seq / step_s,
            "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def merge_rounds(rows, spec, world, peak_tflops):
    """One row from a layout's rounds: the median over all their timed steps (step, model and
    optimizer phase alike), the last round's profile, losses, memory and compile counts (each
    round builds and compiles the layout afresh); each round's own median in ``step_ms_rounds``."""
    if len(rows) == 1 or any("error" in r for r in rows):
        return next((r for r in rows if "error" in r), rows[-1])
    row = dict(rows[-1])
    steps = sorted(t for r in rows for t in r["step_ms_all"])
    row["step_ms_all"] = steps
    row["step_ms_rounds"] = [r["step_ms"] for r in rows]
    row.update(rates(median(steps) / 1e3, spec, world, peak_tflops))
    for phase in ("model", "optim"):
        row[f"{phase}_ms_all"] = sorted(t for r in rows for t in r[f"{phase}_ms_all"])
        row[f"{phase}_ms"] = median(row[f"{phase}_ms_all"])
    row["peak_gib"] = max((r["peak_gib"] for r in rows if r["peak_gib"] is not None), default=None)
    return row


class PhaseClock:
    """Per step, the time of the model phase (forward, backward, gradient norm) and of the
    optimizer phase (clip and AdamW). On CUDA a torch.cuda.Event before, between and after the
    phases (on the current stream: no synchronisation inside the step); on CPU perf_counter."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"
        self.pending, self.model, self.optim = [], [], []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, t0, t1, t2):
        self.pending.append((t0, t1, t2))

    def collect(self):
        """The phases' seconds of the steps added so far (after a synchronize)."""
        for t0, t1, t2 in self.pending:
            if self.cuda:
                self.model.append(t0.elapsed_time(t1) / 1e3)
                self.optim.append(t1.elapsed_time(t2) / 1e3)
            else:
                self.model.append(t1 - t0)
                self.optim.append(t2 - t1)
        self.pending = []


def slowest_rank(times, dev):
    """Each step's time, the max over ranks."""
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class LayoutRun:
    """One layout built and ready to step: its job, optimizer, losses, gradient norms, timed
    steps (``times``, each the slowest rank's, in the order they ran) and ``compiles``, what
    torch.compile did in this layout's own spans (enter it around any other step run)."""

    def __init__(self, lay, spec, args, dev, dtype, batch, meshes, ref_state, builders=None):
        self.lay, self.args, self.dev = lay, args, dev
        self.compiles = CompileStats()
        t0 = time.perf_counter()
        with self.compiles:
            self.job = (builders or BUILDERS)[lay.kind](lay, spec, dev, dtype, batch, meshes=meshes,
                                                        ref_state=ref_state)
        self.build_s = time.perf_counter() - t0
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with self.compiles:
            self.opt, self.optim_step = make_optimizer(args.optimizer, self.job, args.lr, dev)
        self.norms, self.clock, self.losses, self.warmup_s = [], PhaseClock(dev), [], 0.0
        self.times, self.starts = [], []

    def step(self, timed=False):
        clock = self.clock
        t0 = clock.mark() if timed else None
        loss = self.job.fwd_bwd()
        self.norms.append(self.job.norm())       # the gradient norm before clipping
        t1 = clock.mark() if timed else None
        self.optim_step(self.norms[-1])
        if timed:
            clock.add(t0, t1, clock.mark())
        return loss.detach()

    def warmup(self, n):
        t0 = time.perf_counter()
        with self.compiles:
            for _ in range(n):
                self.losses.append(self.step())
            sync(self.dev)
        self.warmup_s = time.perf_counter() - t0

    def timed_step(self):
        """One step between a synchronize and a barrier before and a synchronize after; its wall
        time goes to ``times`` (this rank's until ``row`` takes the slowest rank's)."""
        with self.compiles:     # its snapshots outside the timed span
            sync(self.dev)
            dist.barrier()
            t0 = time.perf_counter()
            self.losses.append(self.step(timed=True))
            sync(self.dev)
            self.times.append(time.perf_counter() - t0)
        self.starts.append(t0)

    def row(self, spec, peak_tflops, prof=None, peak_memory=True):
        """The layout's row from its timed steps, with what torch.compile did (``over_ranks``) and
        the profile's ``prof`` (``sdpa_backend`` "not profiled" without); ``peak_memory=False``
        leaves the peak out (when other layouts' tensors share the GPU)."""
        dev = self.dev
        self.clock.collect()
        in_order = slowest_rank(self.times, dev)
        times = sorted(in_order)
        model_ms = sorted(t * 1e3 for t in slowest_rank(self.clock.model, dev))
        optim_ms = sorted(t * 1e3 for t in slowest_rank(self.clock.optim, dev))
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0],
                            dtype=torch.float64, device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        vals = [float(x) for x in self.losses]
        first_norm = full_tensor(self.norms[0]).item() if self.norms else None
        lay = self.lay
        row = {"layout": lay.name, **rates(median(times), spec, dist.get_world_size(), peak_tflops),
               "model_ms": median(model_ms), "optim_ms": median(optim_ms), "optimizer": OPTIMIZERS[self.args.optimizer],
               "peak_gib": peak.item() if dev.type == "cuda" and peak_memory else None,
               "loss_first": vals[0], "loss_last": vals[-1], "losses": vals, "grad_norm_first": first_norm,
               "build_s": self.build_s, "warmup_s": self.warmup_s,
               "step_ms_all": [t * 1e3 for t in times], "step_ms_in_order": [t * 1e3 for t in in_order],
               "step_starts_s": list(self.starts),
               "model_ms_all": model_ms, "optim_ms_all": optim_ms,
               "microbatches": lay.m, "layout_spec": asdict(lay),
               **over_ranks(self.compiles.fields()), "sdpa_backend": "not profiled"}
        if prof:
            row.update(prof)
        return row

    def close(self):
        del self.job, self.opt, self.optim_step, self.losses, self.norms


def run_layout(lay, spec, args, dev, dtype, batch, meshes, ref_state, peak_tflops, profile=True, builders=None):
    """Build ``lay`` (with ``builders[lay.kind]``, default ``BUILDERS``), run --warmup and --steps
    timed steps (and a profiled one); returns its row."""
    run = LayoutRun(lay, spec, args, dev, dtype, batch, meshes, ref_state, builders)
    run.warmup(args.warmup)
    for _ in range(args.steps):
        run.timed_step()
    prof = None
    if profile and not args.no_profile:
        with run.compiles:
            prof = profiled_step(run.step, lay, args, dev, dist.get_rank())
    row = run.row(spec, peak_tflops, prof)
    run.close()
    return row


def attempt(fn, name, args, dev, meshes):
    """(``fn()``, None), or (None, an error row naming the first rank that failed) when ``fn``
    raised on any rank: every rank learns of a failure on any."""
    rank = dist.get_rank()
    value, err, tb = None, None, None
    if args.hang_dump:     # a layout that hangs (in a collective, say) shows where, every rank
        faulthandler.dump_traceback_later(args.hang_dump, exit=False)
    try:
        value = fn()
    except Exception as exc:    # noqa: BLE001 -- an OOM or a framework error becomes an "error" row
        err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        tb = traceback.format_exc()
        del exc
    finally:
        if args.hang_dump:
            faulthandler.cancel_dump_traceback_later()
    failed = torch.tensor([0.0 if err is None else 1.0], device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return value, None
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    first = next(i for i, e in enumerate(errs) if e is not None)
    if rank == first:
        print(f"[rank {rank}] layout {name} failed:\n{tb}", file=sys.stderr, flush=True)
    forget_failure(meshes)
    return None, {"layout": name, "error": f"rank {first}: {errs[first]}"}


def release(dev):
    """Give the GPU memory and torch.compile's caches of the layouts just run back."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def run_guarded(lay, spec, args, dev, dtype, batch, meshes, ref_state, peak_tflops, profile=True, builders=None):
    """run_layout, with every rank learning whether any rank failed."""
    row, error = attempt(lambda: run_layout(lay, spec, args, dev, dtype, batch, meshes, ref_state, peak_tflops,
                                            profile, builders), lay.name, args, dev, meshes)
    release(dev)
    return error or row


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
