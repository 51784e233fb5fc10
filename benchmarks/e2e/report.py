"""What rank 0 prints: the run's header, a line per layout and round, the table, a line per
row of what torch.compile did, and the --check of every layout's first losses and gradient
norm against the plain model's; and the --json file."""
from __future__ import annotations

import dataclasses
import datetime
import json
import math

import torch

from e2e.compile_stats import describe
from e2e.optimizers import OPTIMIZERS

CHECK_RTOL = 1e-4


def print_header(command, dev_name, world, backend, spec, args, peak_tflops):
    print(f"command: {command}")
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
          f"device {dev_name}, world size {world} ({backend})")
    print(f"{spec.describe()}, global batch {spec.batch}, F = {spec.flops():.4g} FLOP a step; "
          f"{args.dtype} parameters + fp32 master weights, every row's optimizer "
          f"{OPTIMIZERS[args.optimizer]} (AdamW lr {args.lr:g}, clip 1.0); {args.warmup} warm-up + "
          f"{args.steps} timed steps")
    if peak_tflops:
        print(f"bf16 8192^3 matmul: {peak_tflops:.1f} TFLOP/s per GPU"
              + (" (--peak-tflops)" if args.peak_tflops else " (measured, median of 20)"))
    print(flush=True)


def print_round(row, name, r, rounds):
    """The line for one layout in round ``r`` (0-based) of ``rounds``."""
    tag = f"[round {r + 1}/{rounds}] " if rounds > 1 else ""
    if "error" in row:
        print(f"{tag}{name}: error: {row['error']}", flush=True)
    else:
        print(f"{tag}{name}: {row['step_ms']:.1f} ms/step (model {row['model_ms']:.1f}, optimizer "
              f"{row['optim_ms']:.1f}), loss {row['loss_first']:.4f} -> "
              f"{row['loss_last']:.4f} (build {row['build_s']:.1f} s, warm-up {row['warmup_s']:.1f} s)",
              flush=True)


def _fmt(x, spec, width):
    return f"{'-':>{width}}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{width}{spec}}"


def print_table(rows):
    head = (f"{'layout':18} {'step ms':>9} {'model ms':>9} {'optim ms':>8} {'tokens/s':>10} {'TFLOP/s/GPU':>11} "
            f"{'MFU':>6} {'peak GiB':>8} {'loss first->last':>17} {'compute ms':>10} {'exp.comm ms':>11} "
            f"{'bubble ms':>9} {'idle ms':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:18} error: {r['error']}")
            continue
        step = r["step_ms"]

        def part(key, width):
            v = r.get(key)
            if v is None:
                return f"{'-':>{width}}"
            ref = r.get("step_ms_profiled", step)
            return f"{v:{width - 5}.1f}({100 * v / ref:2.0f}%)" if ref else f"{v:{width}.1f}"
        mfu = r.get("mfu")
        mfu = f"{'-':>6}" if mfu is None else f"{100 * mfu:5.1f}%"
        print(f"{r['layout']:18} {step:9.1f} {r['model_ms']:9.1f} {r['optim_ms']:8.1f} {r['tokens_per_s']:10.0f} "
              f"{r['tflops_per_gpu']:11.2f} "
              f"{mfu} {_fmt(r['peak_gib'], '.2f', 8)} "
              f"{r['loss_first']:8.4f}->{r['loss_last']:<7.4f} "
              f"{part('compute_ms', 10)} {part('exposed_comm_ms', 11)} {part('bubble_ms', 9)} {part('idle_ms', 8)}")
    if any("compute_ms" in r for r in rows):
        print("(breakdown: one profiled step on rank 0; % of that step's wall time, printed as step_ms_profiled "
              "in --json)")
        print("where the kernel time goes (ms of the profiled step, by kernel names: e2e/profiling.WORK; idle: no "
              "kernel running):")
        for r in rows:
            if r.get("work_ms"):
                print(f"  {r['layout']:18} " + ", ".join(f"{k} {v:.1f}" for k, v in r["work_ms"].items())
                      + f", idle {r['idle_ms']:.1f}")
    print("(model ms: forward, backward and the gradient norm; optim ms: the clip and AdamW; each the median "
          "over the timed steps of the slowest rank's)")
    if any(r.get("peak_estimated") and r.get("peak_gib") is not None for r in rows):
        print("(peak GiB, --interleave: an estimate of each row alone: what it holds after its warm-up plus the most "
              "a timed step allocated above its start; e2e/interleave.py)")


def print_rounds(rows):
    """Each round's median step time, for the rows with more than one round."""
    for r in rows:
        if "step_ms_rounds" in r:
            print(f"  {r['layout']}: each round's median " + " / ".join(f"{t:.1f}" for t in r["step_ms_rounds"])
                  + " ms")


def print_paired(rows):
    """--interleave: each row's step times against the first layout's, pass by pass."""
    for r in rows:
        if "paired" in r and r["layout"] != r["paired_with"]:
            mid, lo, hi = r["paired"]
            print(f"  {r['layout']}: paired with {r['paired_with']} step by step, {r['paired_with']}'s time / this "
                  f"row's: median {mid:.4f} (middle half {lo:.4f}-{hi:.4f}, {len(r['step_ms_in_order'])} passes)")


def print_compile(rows):
    """A line per row: torch.compile's graph breaks (the first reasons), recompilations and graphs,
    and the SDPA backend of the profiled step."""
    for r in rows:
        if "graph_breaks" in r:
            print(describe(r))


def check_rows(rows, ref_losses, ref_norm, lead):
    """--check: compare each row's first losses and first gradient norm with the plain model's
    (``CHECK_RTOL`` relative), record the result in the row (``row["check"]``) and print it on
    the lead rank. Returns whether any row failed (an error row fails)."""
    failed_check = False
    if lead:
        print(f"\ncheck against the plain model (losses of the first {len(ref_losses)} steps, gradient norm of the "
              f"first; tolerance {CHECK_RTOL} relative):")
    for r in rows:
        if "error" in r:
            failed_check = True
            if lead:
                print(f"  {r['layout']:18} FAILED: {r['error']}")
            continue
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref_losses)]
        rel = max(d / abs(b) for d, b in zip(diffs, ref_losses))
        norm_rel = abs(r["grad_norm_first"] - ref_norm) / abs(ref_norm)
        ok = rel <= CHECK_RTOL and norm_rel <= CHECK_RTOL
        r["check"] = {"max_abs_diff": max(diffs), "max_rel_diff": rel, "grad_norm_rel_diff": norm_rel, "ok": ok}
        failed_check |= not ok
        if lead:
            print(f"  {r['layout']:18} losses {[round(x, 6) for x in r['losses'][:len(ref_losses)]]} "
                  f"max |diff| {max(diffs):.2e} (rel {rel:.2e}); gradient norm {r['grad_norm_first']:.6g} "
                  f"(rel {norm_rel:.2e}) {'ok' if ok else 'FAILED'}")
    if lead:
        print("check: " + ("FAILED" if failed_check else "passed"), flush=True)
    return failed_check


def write_json(path, command, dev_name, world, args, spec, peak_tflops, ref_losses, ref_norm, rows):
    model = {"name": spec.name, "kind": spec.kind, "describe": spec.describe(), "layers": spec.layers,
             "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads, "seq": spec.seq,
             "vocab": spec.vocab, "global_batch": spec.batch, "tied": spec.tied, "params": spec.count_params(),
             "matmul_params": spec.matmul_params(), "flops_per_step": spec.flops(),
             "config": spec.config.to_dict() if spec.kind == "hf" else dataclasses.asdict(spec.config)}
    with open(path, "w") as f:
        json.dump({"command": command, "torch": torch.__version__, "device": dev_name,
                   "world_size": world, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "args": vars(args), "model": model, "optimizer": OPTIMIZERS[args.optimizer],
                   "matmul_tflops": peak_tflops, "reference_losses": ref_losses,
                   "reference_grad_norm": ref_norm,
                   "rows": rows}, f, indent=1)
