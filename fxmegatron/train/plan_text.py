"""The text of a dry-run plan (``RunPlan.format``): the layout, parameters per rank, memory per
rank with the formula and its caveats, the schedule's picture."""
from __future__ import annotations

from typing import TYPE_CHECKING, List

from fxmegatron.train.plan_memory import OPTIMIZER_NOTES, byte_unit

if TYPE_CHECKING:
    from fxmegatron.train.plan import RunPlan

FORMULA = ("total = parameters + gradients + optimizer state + activations (+ recompute); activations = the "
           "most, over the rank's schedule, of the sum of saved(chunk) over the (microbatch, chunk) pairs in "
           "flight (one chunk per rank: saved per microbatch × peak microbatches in flight); recompute = the "
           "largest recomputed region's activations, held while its backward runs it")
CAVEAT = ("an estimate: no allocator overhead or fragmentation, no temporary buffers (workspaces, a "
          "backward's transient gradients, the loss's fp32 scratch beyond what it saves), no communication "
          "buffers (pipeline sends, data-parallel buckets, gathers); attention counted as a fused kernel; dropout "
          "> 0 counted in its torch form (a 1-byte mask per element; the GPU kernel redraws it)")

SHARDED = {"optimizer": "its state", "gradients": "gradients and optimizer state", "full": "parameters (one "
           "block's gathered besides; compiled on GPUs, overlapped), gradients and optimizer state"}


def plan_lines(p: "RunPlan") -> List[str]:
    dt = str(p.param_dtype).replace("torch.", "")
    world = p.dp * p.pp * p.cp * p.tp
    sched = (f"schedule {p.schedule}, {p.pp} pipeline ranks × {p.virtual_stages} chunk(s) each"
             if p.schedule else "no pipeline (gradient accumulation)" if p.microbatches > 1 else "no pipeline")
    size = f" ({p.model_params / 1e9:.2f} B)" if p.model_params >= 1e9 else \
        f" ({p.model_params / 1e6:.1f} M)" if p.model_params >= 1e6 else ""
    out = [f"fxmegatron dry-run plan: {p.model}, {p.model_params:,} parameters{size}, {dt}",
           f"layout: dp {p.dp} × pp {p.pp} × {f'cp {p.cp} × ' if p.cp > 1 else ''}tp {p.tp} = {world} ranks; "
           + (f"ep {p.ep} (folded onto dp: each rank holds {1 / p.ep:.3g} of every block's experts); " if p.ep > 1
              else "")
           + "sequence parallel "
           f"{'on' if p.sequence_parallel else 'off'}; recompute {p.recompute}; {sched}; "
           f"{p.microbatches} microbatch(es) of {', '.join(p.microbatch)} per dp rank",
           f"optimizer {p.optimizer} ({OPTIMIZER_NOTES[p.optimizer]}); gradients {dt}"
           + (" + fp32 sums over the microbatches" if p.grad_accum_dtype is not None else "")
           + (f"; dp_shard {p.dp_shard}: {SHARDED[p.dp_shard]} split over {p.shard_ranks} ranks (dp·cp"
              f"{'' if p.shard_ranks == p.dp * p.cp else ' / dp_replicate'})" if p.dp_shard != "none" else "")
           + (f", the experts' over {max(p.shard_ranks // p.ep, 1)} (the ranks holding the same experts)"
              if p.dp_shard != "none" and p.ep > 1 else ""),
           ""]
    out.append(f"Parameters per rank (elements; tp ranks of a stage hold shards of equal shape: tp rank 0 "
               f"shown, 'stage' = split × {p.tp} + replicated)")
    out.append(f"  {'pp':>2} {'per tp rank':>15} {'split over tp':>15} {'replicated':>13} {'stage':>15}  "
               "chunks: what they run")
    for s in p.stages:
        runs = "; ".join(f"{c}: {units}" for c, units in zip(s.chunks, s.blocks))
        out.append(f"  {s.pp_rank:>2} {s.params:>15,} {s.split:>15,} {s.replicated:>13,} {s.stage_params:>15,}  "
                   f"{runs}")
    total = sum(s.stage_params for s in p.stages)
    others = (p.ep - 1) * sum(s.expert_stage for s in p.stages)     # the other ep ranks' experts
    if p.ep > 1:
        out.append(f"  of which experts (each rank its {1 / p.ep:.3g}): "
                   + ", ".join(f"pp {s.pp_rank} {s.experts:,}" for s in p.stages))
    out.append(f"  sum of stages {total:,}" + (f" + the other ep ranks' experts {others:,}" if p.ep > 1 else "")
               + f" = model {p.model_params:,} + tied copies {p.tied_copies:,}"
               + (f" − {p.unused_numel:,} in {len(p.unused)} parameter(s) no chunk uses: {', '.join(p.unused[:3])}"
                  if p.unused else ""))
    for name, ranks in sorted(p.tied.items()):
        also = [a for a, c in p.aliases.items() if c == name and a != name]
        out.append(f"  tied: {name}{' (also ' + ', '.join(also) + ')' if also else ''} is held by pp ranks "
                   f"{', '.join(map(str, ranks))}: a copy on each, counted once per holder; their gradients "
                   "are summed over pp")
    for a, c in sorted(p.aliases.items()):
        if a != c and c not in p.tied:
            out.append(f"  tied: {a} is {c}: one parameter, counted once")
    if p.coverage:
        out += ["  " + line for line in p.coverage.splitlines()]
    unit, scale = byte_unit(max(s.total_bytes for s in p.stages))

    def b(n: int) -> str:
        return f"{n / scale:.2f}"

    rc = any(s.recompute_bytes for s in p.stages)
    out += ["", f"Memory per rank ({unit}, estimate; tp ranks alike: tp rank 0 shown)",
            f"  {'pp':>2} {'params':>8} {'grads':>8} {'optimizer':>10} {'activations':>12}  "
            f"{'(chunk: saved per microbatch × most in flight)':<46}" + (f" {'recompute':>10}" if rc else "")
            + f" {'total':>8}"]
    for s in p.stages:
        per = ", ".join(f"{c}: {b(s.saved[c])} × {s.in_flight[c]}" for c in s.chunks)
        out.append(f"  {s.pp_rank:>2} {b(s.param_bytes):>8} {b(s.grad_bytes):>8} {b(s.optimizer_bytes):>10} "
                   f"{b(s.activation_bytes):>12}  {per:<46}" + (f" {b(s.recompute_bytes):>10}" if rc else "")
                   + f" {b(s.total_bytes):>8}")
    worst = max(p.stages, key=lambda s: s.total_bytes)
    out += [f"  largest: pp rank {worst.pp_rank}, {b(worst.total_bytes)} {unit}", f"  {FORMULA}", f"  {CAVEAT}"]
    if p.schedule:
        out += ["", f"Schedule {p.schedule}: p={p.pp}, v={p.virtual_stages}, m={p.microbatches}; bubble fraction "
                    f"{p.bubble:.3f} (idle / compute; a stage's forward = 1 cell, backward = 2)", p.timeline]
    out += ["", *[f"note: {n}" for n in p.notes], f"planned in {p.seconds:.1f} s"]
    return out
