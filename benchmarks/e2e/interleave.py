"""--interleave: every layout built and warmed up first, then --steps passes in each of which
every layout runs one timed step, every other pass in reverse order (A B, B A, A B, ...).

Rounds (``--rounds``) run a layout's steps back to back and the layouts one after the other,
seconds to minutes apart; the GPU runs at its power limit and its clock drifts by a few percent
over such spans, as much as the differences measured (docs/history/PERFORMANCE-2026-11-26.md). Interleaved, the
steps compared are under a second apart, so a drift reaches every layout alike, and each pass
pairs one step of every layout with one of the first layout's: a row's ``paired`` is the median
over the passes of (the first layout's step time / this layout's), with the middle half of those
ratios as its spread.

Every layout's weights and optimizer states are on the GPU at once, so the GPU's peak is no
row's own. A row's peak here is an estimate of what it would reach alone: what the layout holds
after its warm-up (weights, gradients, optimizer states: the allocated bytes it added, built and
warmed up while the layouts before it sat still) plus the most a timed step of it allocated
above what was allocated when that step began; the max over ranks. There is no profiled step
(run without --interleave for one)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from e2e.measure import LayoutRun, attempt, median, release


def allocated(dev) -> int:
    return torch.cuda.memory_allocated() if dev.type == "cuda" else 0


def own_peak_gib(resident: int, transient: list, dev):
    """The row's estimated peak (module docstring), the max over ranks; None off the GPU."""
    if dev.type != "cuda":
        return None
    t = torch.tensor([(resident + max(transient, default=0)) / 2**30], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def paired(first, row):
    """(median, lower quartile, upper quartile) of first's step time over row's, pass by pass."""
    ratios = sorted(a / b for a, b in zip(first["step_ms_in_order"], row["step_ms_in_order"]))
    n = len(ratios)
    return median(ratios), ratios[n // 4], ratios[(3 * n) // 4]


def run_interleaved(layouts, spec, args, dev, dtype, batch, meshes, ref_state_for, peak_tflops, builders=None):
    """The rows of ``layouts`` run as the module docstring says; ``ref_state_for(lay)``: the
    initial weights handed to ``lay``'s builder (or None). A layout that fails becomes an error
    row and leaves the passes; the others go on."""
    runs, errors, resident, transient = {}, {}, {}, {}

    def ready(lay):
        a0 = allocated(dev)
        run = LayoutRun(lay, spec, args, dev, dtype, batch, meshes, ref_state_for(lay), builders)
        run.warmup(args.warmup)
        resident[lay.name], transient[lay.name] = allocated(dev) - a0, []
        return run

    def step(lay):
        a = allocated(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        runs[lay.name].timed_step()
        if dev.type == "cuda":
            transient[lay.name].append(torch.cuda.max_memory_allocated() - a)

    for lay in layouts:
        run, err = attempt(lambda lay=lay: ready(lay), lay.name, args, dev, meshes)
        if err:
            errors[lay.name] = err
        else:
            runs[lay.name] = run
    for i in range(args.steps):
        for lay in (layouts if i % 2 == 0 else layouts[::-1]):
            if lay.name not in runs:
                continue
            _, err = attempt(lambda lay=lay: step(lay), lay.name, args, dev, meshes)
            if err:
                errors[lay.name] = err
                runs.pop(lay.name).close()
    rows = []
    for lay in layouts:
        if lay.name in errors:
            rows.append(errors[lay.name])
            continue
        row, err = attempt(lambda lay=lay: runs[lay.name].row(spec, peak_tflops, peak_memory=False), lay.name, args,
                           dev, meshes)
        if row is not None:
            row["peak_gib"] = own_peak_gib(resident[lay.name], transient[lay.name], dev)
            row["peak_estimated"] = True
        rows.append(err or row)
    for run in runs.values():
        run.close()
    release(dev)
    first = rows[0]
    if "error" not in first:
        for row in rows:
            if "error" not in row:
                row["paired"] = paired(first, row)
                row["paired_with"] = first["layout"]
    return rows
