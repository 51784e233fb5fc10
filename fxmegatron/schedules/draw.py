"""Draw a schedule's simulated timeline (one row per rank) to PNG or SVG.

Usage::

    python -m fxmegatron.schedules.draw --schedule interleaved -p 4 -v 2 -m 8 \\
        --out docs/img/interleaved_p4_v2_m8.png
    python -m fxmegatron.schedules.draw --schedule 1f1b -p 4 -m 8 --print

Uses matplotlib's Agg canvas directly (no pyplot), so it works headless and
does not touch the caller's global backend.
"""
from __future__ import annotations

import argparse
import os
import sys

from fxmegatron.schedules.actions import Schedule, ScheduleError
from fxmegatron.schedules.generate import SCHEDULE_NAMES, make_schedule
from fxmegatron.schedules.simulate import simulate


def _colour(kind: str, local_chunk: int, v: int):
    """Blues for forwards, oranges for backwards; darker for later local chunks."""
    from matplotlib import colormaps

    shade = 0.4 + 0.4 * (local_chunk / (v - 1) if v > 1 else 0.5)
    return colormaps["Blues" if kind == "F" else "Oranges"](shade)


def _legend_handles(v: int):
    from matplotlib.patches import Patch

    handles = []
    for kind, word in (("F", "forward"), ("B", "backward")):
        for j in range(v):
            label = word if v == 1 else f"{word}, local chunk {j}"
            handles.append(Patch(facecolor=_colour(kind, j, v), edgecolor="black", label=label))
    return handles


def _draw_rank(ax, row: int, timeline, p: int, v: int) -> None:
    for start, end, a in timeline:
        local = a.chunk // p
        ax.broken_barh([(start, end - start)], (row - 0.4, 0.8),
                       facecolors=_colour(a.kind, local, v), edgecolors="black",
                       linewidth=0.5)
        ax.text((start + end) / 2, row, str(a.microbatch), ha="center", va="center",
                fontsize=7 if end - start >= 0.45 else 5)


def draw_timeline(schedule: Schedule, path: str, f_time: float = 1, b_time: float = 2) -> str:
    """Simulate ``schedule`` and draw its timeline to ``path`` (``.png`` or
    ``.svg``): boxes for F (blues) and B (oranges) labelled with the
    microbatch, shaded by local chunk when ``v > 1``.  Returns ``path``."""
    from matplotlib.figure import Figure

    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise ScheduleError(f"draw_timeline writes .png or .svg, got {path!r}")
    res = simulate(schedule, f_time, b_time)
    p, v = schedule.p, schedule.v
    fig = Figure(figsize=(max(8.0, 0.35 * res.makespan * v), 0.6 * p + 1.8))
    ax = fig.add_subplot()
    for r in range(p):
        _draw_rank(ax, r, res.timeline[r], p, v)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xlim(0, res.makespan)
    ax.set_xlabel(f"time (forward of a stage = {f_time}, backward = {b_time})")
    ax.set_title(f"{schedule.name}: p={p}, v={v}, m={schedule.m}, "
                 f"bubble fraction = {res.overall_bubble_fraction:.3f}")
    ax.legend(handles=_legend_handles(v), loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=min(2 * v, 4), fontsize=7, frameon=False)
    fig.tight_layout()
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fxmegatron.schedules.draw",
                                 description="Simulate and draw a pipeline schedule.")
    ap.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    # the names the other commands use (compile, verify, the trainer's layout keys); -p/-v/-m as short forms
    ap.add_argument("--pp", "-p", dest="p", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--virtual-stages", "-v", dest="v", type=int, default=1, help="model chunks per rank")
    ap.add_argument("--microbatches", "-m", dest="m", type=int, required=True, help="microbatches")
    ap.add_argument("--f-time", type=float, default=1.0, help="forward time of one stage")
    ap.add_argument("--b-time", type=float, default=2.0, help="backward time of one stage")
    ap.add_argument("--out", help="output .png or .svg")
    ap.add_argument("--print", action="store_true", help="print each rank's action list")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.out and not args.print:
        _parser().error("give --out PATH and/or --print")
    try:
        schedule = make_schedule(args.schedule, args.p, args.v, args.m)
        if args.print:
            print(schedule)
            res = simulate(schedule, args.f_time, args.b_time)
            print(f"makespan={res.makespan:g} bubble_fraction={res.overall_bubble_fraction:.4f} "
                  f"peak_in_flight={res.peak_in_flight}")
        if args.out:
            print(f"wrote {draw_timeline(schedule, args.out, args.f_time, args.b_time)}")
    except ScheduleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
