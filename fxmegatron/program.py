"""``RankProgram``: one rank's piece of the parallel program, as the compiler leaves it and the
runtime runs it.

``parallelize`` builds one from a model (``fxmegatron.compiler.compile_program``) and
``fxmegatron.io.stage_folder.load_folder`` from a compiled folder; ``ParallelModel`` runs
either. The stage-folder writer, the checkpoint code and the dump read its fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.mesh import Axis
from fxmegatron.passes.pipeline_split import Chunk, param_holders
from fxmegatron.placement import Placement, Placements, R, Shard
from fxmegatron.lower.stages import Stage
from fxmegatron.schedules import Schedule
from fxmegatron.schedules.runtime import TensorSpec


@dataclass(frozen=True)
class PipelineProgram:
    """What a pipelined rank runs: the schedule, every chunk's description (graphs on meta
    for the dump) and this rank's materialised stage."""

    schedule: Schedule
    chunks: Tuple[Chunk, ...]
    stage: Stage
    specs: Mapping[int, List[TensorSpec]]      # chunk index -> what it sends to the next chunk

    @property
    def batch_inputs(self) -> Dict[int, List[int]]:
        return {c.index: c.batch_inputs for c in self.chunks}

    def holders(self) -> Dict[str, Tuple[int, ...]]:
        return param_holders(self.chunks, self.schedule.p)

    def uses(self) -> Dict[int, int]:
        """id(parameter) -> how many of this rank's chunks use it: its gradient accumulations
        per microbatch (each chunk's backward is a separate one)."""
        uses: Dict[int, int] = {}
        params = self.stage.params
        for c in self.chunks:
            if c.index in self.stage.modules:
                for name in c.params:
                    if name in params:
                        k = id(params[name])
                        uses[k] = uses.get(k, 0) + 1
        return uses


@dataclass(frozen=True)
class RankProgram:
    """One rank's program. Exactly one of ``graph_module`` (no pipeline) and ``pipeline``
    is set. Parameter names are the original model's (canonical: one per tied group,
    ``aliases`` maps the others)."""

    axes: Mapping[str, Axis]
    device: torch.device
    in_spec: Any                                  # pytree spec of the batch (args, kwargs)
    input_names: Tuple[str, ...]
    example_inputs: Tuple[torch.Tensor, ...]      # meta tensors: the graph's inputs (a microbatch)
    param_order: Tuple[str, ...]
    global_params: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]]   # unsplit shape and dtype
    aliases: Mapping[str, str]
    placements: Mapping[str, Placement]
    sequence_parallel: bool
    recompute: str
    seed: int
    microbatches: int
    graph_module: Optional[fx.GraphModule] = None
    pipeline: Optional[PipelineProgram] = None
    replicated: Mapping[str, str] = field(default_factory=dict)   # parameter -> why tp keeps it whole
    planning_attempts: int = 0
    count_tokens: Optional[Callable] = None       # flat microbatch -> tokens its loss averages over
    token_count: Optional[Callable] = None        # the same counter also when the batch is not split:
                                                  # a compiled folder keeps it for dp or microbatches
    check_ids: Optional[Callable] = None          # flat microbatch -> None, or a BatchError (runtime.id_check)
    coverage: Any = None                          # passes.tp_coverage.Coverage, when compiled here
    notes: Tuple[str, ...] = ()                   # what capture changed
    timings: Mapping[str, float] = field(default_factory=dict)
    dp_shards: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)   # dp_shard="full": name -> local shape
    experts: Mapping[str, int] = field(default_factory=dict)   # expert parallelism: name -> its experts dim

    def __post_init__(self):
        if (self.graph_module is None) == (self.pipeline is None):
            raise ValueError("a RankProgram holds a graph module or a pipeline, exactly one")

    def placement(self, name: str) -> Placement:
        return self.placements.get(self.aliases.get(name, name), R)

    def param_layout(self, name: str) -> Placements:
        """Parameter ``name``'s placement per mesh axis: over tp, and an expert weight's experts
        dim over ep (every other axis holds it whole, or not at all: pp)."""
        name = self.aliases.get(name, name)
        experts, axes = getattr(self, "experts", {}), getattr(self, "axes", {})
        ep = Shard(experts[name]) if name in experts and "ep" in axes and axes["ep"].size > 1 else None
        return Placements.of(tp=self.placement(name), ep=ep)

    def shard_axis(self, name: str) -> Axis:
        """The ranks over which parameter ``name``'s ``dp_shard="full"`` shards are spread: an expert
        weight under expert parallelism over the ranks holding the same experts ("edp"), any other
        over dp × cp (under hybrid sharding one replica group's: "dp_cp")."""
        name = self.aliases.get(name, name)
        if name in self.experts and "ep" in self.axes and self.axes["ep"].size > 1:
            return self.axes["edp"]
        return self.axes.get("dp_cp", self.axes["dp"])

    def coords(self) -> Dict[str, Tuple[int, int]]:
        """{axis: (this rank, the axis's size)}."""
        return {d: (a.rank, a.size) for d, a in self.axes.items()}

    def size(self, dim: str) -> int:
        return self.axes[dim].size

    def rank(self, dim: str) -> int:
        return self.axes[dim].rank
