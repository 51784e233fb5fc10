"""The compiler: a model and a layout in, one rank's ``RankProgram`` out.

``compile_program`` is the whole flow, one direction: capture, the graph passes (a flat
list run by ``passes.runner.PassRunner``), the pipeline split, and one materialisation of
this rank's shards at the end. Until then the rank's graph holds meta tensors of the local
shapes, so every pass sees consistent shapes and nothing is allocated.
"""
from __future__ import annotations

import time
from typing import Mapping, Optional

import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.capture import Captured, capture
from fxmegatron.errors import LossError, ScheduleError, ShardingError
from fxmegatron.layout import Layout
from fxmegatron.lower.rank import build_rank
from fxmegatron.lower.rank_passes import EXPERT_CUT, schedules_collectives
from fxmegatron.lower.stages import token_counter
from fxmegatron.lower.torch_compile import compile_graph
from fxmegatron.mesh import Axis
from fxmegatron.passes.dp_shard import DP_SHARD
from fxmegatron.passes import batch_term
from fxmegatron.passes.loss_terms import check_split_loss, split_by
from fxmegatron.program import PipelineProgram, RankProgram
from fxmegatron.runtime.id_check import id_checker
from fxmegatron.runtime.microbatches import split_batch


def compile_program(model: nn.Module, example_batch, axes: Mapping[str, Axis], device,
                    cfg: Layout, debug: bool = False) -> RankProgram:
    """This rank's program. ``debug``: the fake shape check after every pass. (``parallelize``
    has checked the layout before it comes here.)"""
    t0 = time.perf_counter()
    cap = capture(model, first_microbatch(example_batch, cfg.microbatches, axes["dp"].size))
    return compile_captured(cap, axes, device, cfg, debug, {"capture_s": time.perf_counter() - t0})


def compile_captured(cap: Captured, axes: Mapping[str, Axis], device, cfg: Layout, debug: bool = False,
                     timings: Optional[dict] = None) -> RankProgram:
    """The rank's program from a capture (whose graph it transforms in place: give each rank
    its own copy). The road from capture to modules is ``lower.rank.build_rank``, which
    ``verify`` and the dry-run plan take too."""
    cfg = cfg.with_degrees(axes)
    dp = axes["dp"]
    if cfg.ep > 1 and axes.get("ep", Axis()).size != cfg.ep:
        raise ShardingError(f"parallelize(ep={cfg.ep}): expert parallelism folds onto the data-parallel ranks, and "
                            f"this mesh has {dp.size} (a mesh with a 'dp' dim of a multiple of {cfg.ep})")
    sched = cfg.make_schedule()
    split = cfg.microbatches > 1 or dp.size > 1
    # before the passes rewrite the loss
    check_split_loss(cap.gm, cfg.microbatches, dp.size, batch_term.split_term(batch_term.applies(cfg)))
    check_ids = id_checker(cap.gm, cap.input_names, device)  # the whole vocabulary: before tp splits it
    timings = dict(timings or {})
    coords = {n: axes[n].rank for n in ("dp", "pp", "cp", "tp", "dp_cp", "ep") if n in axes}
    named = ("tp", "cp", "dp_cp", "dp_replicate", "ep", "edp")     # edp: the experts' shards (dp_shard="full")
    built = build_rank(cap, cfg, coords, device, {n: axes[n].group_name for n in named if n in axes},
                       debug=debug)
    local, plan, placeholders = built.local, built.plan, built.placeholders
    mode = cfg.compile if isinstance(cfg.compile, str) else None
    # dp_shard="full" on GPUs: inductor schedules its gathers and reduce-scatters (prefetch, overlap)
    scheduled = schedules_collectives(cfg, axes, device)
    t0 = time.perf_counter()
    gm, pipe = built.whole, None
    if sched is None:
        if cfg.compile:
            compile_graph(gm, mode, schedule_collectives=scheduled)
    else:
        stage = built.stages[coords.get("pp", 0)]
        if cfg.compile:
            for m in stage.modules.values():
                compile_graph(m, mode, schedule_collectives=scheduled)
        pipe = PipelineProgram(sched, tuple(built.chunks), stage, built.specs)
    timings.update(built.timings)
    timings["materialize_s"] += time.perf_counter() - t0
    counter = token_counter(local, device)
    # unsplit, no count to make each step; a loss weighted in the graph (passes.batch_term) is weighed by one
    weighted = bool(local.meta.get(batch_term.WEIGHTED))
    count = counter if split and not weighted else None
    if split and count is None and not weighted:
        raise LossError(f"parallelize({split_by(cfg.microbatches, dp.size)}) weights each piece of the batch by the "
                        "labels its cross-entropy counts, but those counts cannot be computed from the batch alone "
                        "(the graph holds several cross-entropies, or the target reads weights, buffers or "
                        "submodules): train this model without splitting the batch (microbatches=1 and no dp)")
    return RankProgram(
        axes=dict(axes), device=device, in_spec=cap.in_spec, input_names=tuple(cap.input_names),
        example_inputs=placeholders, param_order=tuple(cap.params),
        global_params={n: (tuple(t.shape), t.dtype) for n, t in cap.params.items()},
        aliases=dict(cap.aliases), placements=dict(plan.param_plc), sequence_parallel=plan.sequence_parallel,
        recompute=cfg.recompute_name, seed=cfg.seed, microbatches=cfg.microbatches, graph_module=gm,
        pipeline=pipe, replicated=dict(plan.replicated_params), planning_attempts=plan.attempts,
        count_tokens=count, token_count=counter, check_ids=check_ids, coverage=built.coverage,
        notes=tuple(cap.notes), timings=timings, dp_shards=dict(local.meta.get(DP_SHARD, {})),
        experts=dict(local.meta[EXPERT_CUT][0]) if EXPERT_CUT in local.meta else {})


def first_microbatch(batch, m: int, dp: int = 1):
    """The graph is traced at microbatch size (shapes are static): the example batch (the
    global batch of a step) split over dp ranks, then into m microbatches; the first piece."""
    if m < 1:
        raise ScheduleError(f"microbatches={m}: must be >= 1")
    if m * dp == 1:
        return batch
    flat, spec = pytree.tree_flatten(batch)
    names = [f"example batch input {i}" for i in range(len(flat))]
    if dp > 1:
        flat = split_batch(flat, dp, names, f"dp={dp}")[0]
    return pytree.tree_unflatten(split_batch(flat, m, names)[0], spec)
