"""``ParallelConfig``: every option of ``parallelize`` in one frozen, validated value.

``parallelize``'s keyword arguments stay its public signature; they build this, which
is checked once, here, before the (long) transformation starts, and then drives the
compiler's list of passes. ``parallelize``'s docstring says what each option does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch

from fxmegatron.errors import PrecisionError, ShardingError
from fxmegatron.lower.torch_compile import check_compile_options
from fxmegatron.ops.fp8 import recipe_of
from fxmegatron.ops.overlapped_linear import TRANSPORTS
from fxmegatron.passes.fp8 import FP8Policy
from fxmegatron.passes.recompute import RecomputePolicy
from fxmegatron.runtime.grad_accumulation import check_grad_accum_dtype
from fxmegatron.schedules import Schedule, ScheduleError, make_schedule


PRECISIONS = ("bf16", "fp8")


@dataclass(frozen=True)
class ParallelConfig:
    sequence_parallel: bool = False
    recompute: Union[str, RecomputePolicy] = "none"
    microbatches: int = 1
    virtual_stages: int = 1
    schedule: Optional[str] = None
    blocks_per_chunk: Optional[Tuple[int, ...]] = None
    fuse: bool = False
    compile: Union[bool, str] = False
    tp_comm_overlap: int = 0
    tp_comm_transport: str = "auto"
    state_dict: Optional[Mapping[str, Any]] = None
    seed: int = 0
    verbose: bool = False
    grad_accum_dtype: Optional[torch.dtype] = None
    verify: bool = False
    min_split: float = 0.5
    chunked: bool = False      # build the pipeline form at pp=1 (stage folders need it)
    cp_attention: str = "ring"
    precision: str = "bf16"
    fp8_recipe: str = "tensorwise"
    fp8_policy: Union[str, Sequence[str], FP8Policy] = "all"

    def __post_init__(self):
        check_compile_options(self.compile, self.fuse)
        check_grad_accum_dtype(self.grad_accum_dtype)
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ShardingError(f"parallelize(tp_comm_overlap={self.tp_comm_overlap}) overlaps sequence "
                                "parallelism's all-gathers and reduce-scatters with matmuls: it needs "
                                "sequence_parallel=True")
        if not isinstance(self.tp_comm_overlap, int) or self.tp_comm_overlap < 0:
            raise ShardingError(f"parallelize(tp_comm_overlap={self.tp_comm_overlap!r}): expected a number of "
                                "batch pieces >= 0 (0: off)")
        if self.tp_comm_transport not in TRANSPORTS:
            raise ShardingError(f"parallelize(tp_comm_transport={self.tp_comm_transport!r}): expected one of "
                                f"{TRANSPORTS}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"microbatches={self.microbatches}: must be >= 1")
        RecomputePolicy.of(self.recompute)     # an unknown mode names itself here
        if self.precision not in PRECISIONS:
            raise PrecisionError(f"parallelize(precision={self.precision!r}): expected one of {PRECISIONS}")
        if self.precision == "fp8":
            recipe_of(self.fp8_recipe)                                   # an unknown recipe names itself
            object.__setattr__(self, "fp8_policy", FP8Policy.of(self.fp8_policy))
            if self.tp_comm_overlap:
                raise PrecisionError("parallelize(precision='fp8', tp_comm_overlap=...): the merged linears of "
                                     "tp_comm_overlap have no FP8 form yet: use one or the other")
            if self.verify:
                raise PrecisionError("parallelize(precision='fp8', verify=True): verify compares with the model in "
                                     "eager, which runs no FP8: verify the layout without fp8")
        if self.cp_attention not in ("ring", "allgather"):
            raise ShardingError(f"parallelize(cp_attention={self.cp_attention!r}): expected 'ring' or 'allgather'")
        if self.blocks_per_chunk is not None:
            object.__setattr__(self, "blocks_per_chunk", tuple(self.blocks_per_chunk))

    @property
    def recompute_name(self) -> str:
        r = self.recompute
        return r if isinstance(r, str) else getattr(r, "name", str(r))

    def pipelined(self, pp: int) -> bool:
        """Whether the program is cut into chunks run by a schedule."""
        return pp > 1 or self.virtual_stages > 1 or self.chunked

    def make_schedule(self, pp: int) -> Optional[Schedule]:
        """The pipeline schedule for a ``pp``-way pipeline (None without one); checks the
        layout before the transformation."""
        if self.pipelined(pp):
            name = self.schedule or ("interleaved" if self.virtual_stages > 1 else "1f1b")
            return make_schedule(name, pp, self.virtual_stages, self.microbatches)
        if self.schedule not in (None, "gpipe", "1f1b"):
            raise ScheduleError(f"schedule={self.schedule!r} needs a pipeline (a 'pp' mesh dim > 1 or "
                                "virtual_stages > 1)")
        return None
