"""``build_rank``: the one road from a capture to a rank's modules. The rank's graph passes
(``rank_passes``), then, with a pipeline, the cut into pp·v chunks (``split_pipeline``), the
shapes that cross their boundaries and the stage of each pipeline rank asked for
(``build_stage``); without one, the whole graph materialised.

``parallelize`` (``compiler.compile_captured``) builds its own pipeline rank, ``verify``
every pipeline rank of a simulated tp rank, and the dry-run plan none (the passes and the
cut alone, on meta): they differ only in ``stages``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch.fx as fx

from fxmegatron.capture import Captured
from fxmegatron.lower.materialize import materialize_graph
from fxmegatron.lower.rank_passes import (CP_AXIS, COVERAGE, DP_AXIS, DP_REPLICATE_AXIS, EDP_AXIS, EP_AXIS, EXPERT_CUT,
                                          PLAN, TP_AXIS, rank_passes)
from fxmegatron.passes.dp_shard import DP_SHARD
from fxmegatron.lower.stages import Stage, boundary_specs, build_stage
from fxmegatron.mesh import Axis
from fxmegatron.passes.pipeline_split import Chunk, split_pipeline
from fxmegatron.passes.runner import PassRunner
from fxmegatron.passes.tensor_parallel import TPPlan
from fxmegatron.passes.tp_coverage import Coverage
from fxmegatron.schedules.runtime import TensorSpec

AXES = ("dp", "pp", "cp", "tp")


@dataclass
class RankBuild:
    """What ``build_rank`` made: the rank's graph after its passes (meta shards, placements in
    ``node.meta``), and either the whole graph materialised or the chunks and stages."""

    local: fx.GraphModule
    plan: TPPlan
    coverage: Coverage
    placeholders: Tuple                          # the local graph's inputs (fake, microbatch size)
    whole: Optional[fx.GraphModule] = None       # no pipeline: the materialised graph
    chunks: Optional[List[Chunk]] = None         # a pipeline: its pp·v chunks, in order
    specs: Dict[int, List[TensorSpec]] = field(default_factory=dict)   # chunk -> what it sends on
    stages: Dict[int, Stage] = field(default_factory=dict)             # pipeline rank -> its stage
    timings: Dict[str, float] = field(default_factory=dict)            # "<pass>_s", "materialize_s"


def rank_axes(layout, coords: Mapping[str, int], groups: Mapping[str, str]) -> Dict[str, Axis]:
    """Each axis of ``layout`` as the rank at ``coords`` sees it (``groups``: axis -> group name)."""
    out = {}
    for n in AXES:
        size = getattr(layout, n)
        out[n] = Axis(size, coords.get(n, 0), groups.get(n, ""), tuple(range(size)))
    # the ranks that shard (dp × cp, or under dp_replicate one replica group's) and, under
    # dp_replicate, the ranks holding the same shard (``mesh.mesh_axes``)
    replicas, dp = layout.dp_replicate, coords.get("dp", 0)
    group_dp = layout.dp // replicas
    size = group_dp * layout.cp
    out["dp_cp"] = Axis(size, coords.get("dp_cp", dp % group_dp * layout.cp + coords.get("cp", 0)),
                        groups.get("dp_cp", ""), tuple(range(size)))
    out["dp_replicate"] = Axis(replicas, dp // group_dp, groups.get("dp_replicate", ""), tuple(range(replicas)))
    # expert parallelism: ep consecutive dp ranks share their experts, and the dp / ep ranks × cp
    # holding the same ones sum their gradients (dp-major, as ``mesh.mesh_axes`` flattens them);
    # under dp_replicate those of one replica group, the others' being "dp_replicate" as above
    ep = getattr(layout, "ep", 1)
    out["ep"] = Axis(ep, coords.get("ep", dp % ep), groups.get("ep", ""), tuple(range(ep)))
    edp = group_dp // ep * layout.cp
    out["edp"] = Axis(edp, dp % group_dp // ep * layout.cp + coords.get("cp", 0), groups.get("edp", ""),
                      tuple(range(edp)))
    return out


def build_rank(cap: Captured, layout, coords: Mapping[str, int], device, groups: Mapping[str, str], *,
               stages: Optional[Sequence[int]] = None, graph: Optional[fx.GraphModule] = None,
               debug: bool = False) -> RankBuild:
    """The rank at ``coords`` ({"tp": r, "pp": r, "dp": r, "cp": r}; left out: 0) of ``layout``
    (a ``fxmegatron.layout.Layout``), its collectives bound to ``groups`` ({"tp": group name,
    "cp": ...}), materialised on ``device`` (None: planning, nothing is materialised).
    ``stages``: the pipeline ranks whose stage to build (None: the rank's own; empty: none).
    ``graph``: the graph to transform, in place (default: the capture's own). ``debug``: the
    fake shape check after every pass."""
    graph = cap.gm if graph is None else graph
    axes = rank_axes(layout, coords, groups)
    runner = PassRunner(rank_passes(cap, axes, layout, device), debug=debug)
    local = runner(graph)
    plan = local.meta[PLAN]
    placeholders = tuple(n.meta["val"] for n in local.graph.nodes if n.op == "placeholder")
    out = RankBuild(local, plan, local.meta[COVERAGE], placeholders,
                    timings={f"{name}_s": s for name, s in runner.timings.items()})
    build = [coords.get("pp", 0)] if stages is None else list(stages)
    if device is None:
        build = []
    bound = {TP_AXIS: groups.get("tp", ""), CP_AXIS: groups.get("cp", ""), DP_AXIS: groups.get("dp_cp", ""),
             DP_REPLICATE_AXIS: groups.get("dp_replicate", ""), EP_AXIS: groups.get("ep", ""),
             EDP_AXIS: groups.get("edp", "")}
    # dp_shard="full": the parameters' shards over dp × cp (under dp_replicate, one replica group's
    # dp ranks × cp), whose ranks are dp-major; an expert weight's over the ranks holding the same
    # experts (``rank_passes.expert_shards``)
    shards = local.meta.get(DP_SHARD)
    experts = local.meta.get(EXPERT_CUT)
    shard_over = {n: (axes["edp"].size, axes["edp"].rank)
                  for n in (experts[0] if experts else ()) if n in (shards or ())}
    shard_at = dict(shards=shards, shard_world=axes["dp_cp"].size, shard_rank=axes["dp_cp"].rank,
                    experts=experts, shard_over=shard_over)
    tp, tp_rank = layout.tp, coords.get("tp", 0)
    t0 = time.perf_counter()
    if not layout.pipelined():
        if build:
            out.whole = materialize_graph(local, cap, plan.param_plc, tp_rank, tp, device, layout.state_dict,
                                          layout.seed, source=graph, groups=bound, **shard_at)
    else:
        out.chunks = split_pipeline(local, layout.n_chunks, blocks_per_chunk=layout.blocks_per_chunk)
        if build:
            out.specs = boundary_specs(out.chunks, placeholders)
        for r in build:
            out.stages[r] = build_stage(out.chunks, layout.pp, r, cap, plan.param_plc, tp_rank, tp, device,
                                        layout.state_dict, layout.seed, local, source=graph, groups=bound, **shard_at)
    out.timings["materialize_s"] = time.perf_counter() - t0
    return out
