"""``Layout``: a parallel layout in one frozen, validated value: the degree of every mesh axis
and every option of ``parallelize``.

It is the one list of options. ``parallelize``'s keyword arguments, the trainer's
``[layout]`` keys, ``verify``'s layout, the dry-run plan and the command line's flags are
built from (or checked against, ``tests/test_layout.py``) its fields; it owns the schedule's
names and its default, and it is checked once, here, before the (long) transformation.
``parallelize``'s docstring says what each option does.

Each field says in its metadata which kind it is: ``degree`` (a mesh axis), ``option`` (a
choice of the layout) or ``run`` (what ``parallelize`` also takes but that is not the
layout's: where the weights come from, the seed, printing, checks); ``describe`` shows
the first two.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from fxmegatron.errors import PrecisionError, ShardingError
from fxmegatron.lower.torch_compile import check_compile_options
from fxmegatron.ops.fp8 import RECIPES, recipe_of
from fxmegatron.ops.overlapped_linear import TRANSPORTS
from fxmegatron.passes.expert_parallel.capacity import check_capacity_factor
from fxmegatron.passes.fp8 import FP8Policy
from fxmegatron.passes.recompute import RecomputePolicy
from fxmegatron.runtime.grad_accumulation import check_grad_accum_dtype
from fxmegatron.runtime.sharded_dp import DP_SHARD_MODES
from fxmegatron.schedules import Schedule, ScheduleError, make_schedule
from fxmegatron.schedules.generate import SCHEDULE_NAMES

PRECISIONS = ("bf16", "fp8")
CP_ATTENTIONS = ("ring", "allgather")
RECOMPUTE_MODES = ("none", "selective", "full")
DEGREES = ("dp", "pp", "cp", "tp")      # the mesh axes, outermost first


# the trainer's [layout] keys that are not the field's name: tp_comm_overlap was "overlap" first
TOML_ALIASES = {"tp_comm_overlap": ("overlap",)}
# what a TOML key (which has no None) holds for "the default"
TOML_EMPTY = {"schedule": "", "blocks_per_chunk": [], "moe_capacity_factor": 0}
# options without a command-line flag: chunked is compile's own (it always writes chunks)
CLI_LEFT_OUT = ("chunked",)
CLI_CHOICES = {"recompute": RECOMPUTE_MODES, "schedule": SCHEDULE_NAMES, "tp_comm_transport": TRANSPORTS,
               "cp_attention": CP_ATTENTIONS, "dp_shard": DP_SHARD_MODES, "precision": PRECISIONS, "fp8_recipe": tuple(sorted(RECIPES))}


def _f(kind: str, default, **meta):
    return field(default=default, metadata={"kind": kind, **meta})


def default_schedule(virtual_stages: int) -> str:
    """The schedule a pipeline runs when none is named: the one place this default lives."""
    return "interleaved" if virtual_stages > 1 else "1f1b"


@dataclass(frozen=True, kw_only=True)
class Layout:
    # keywords only: verify's former Layout took (tp, pp, v, m, dp, ...) by position, and this
    # one's fields are in another order; a positional call fails rather than mean something else
    dp: int = _f("degree", 1)
    pp: int = _f("degree", 1)
    cp: int = _f("degree", 1)
    tp: int = _f("degree", 1)
    sequence_parallel: bool = _f("option", False)
    recompute: Union[str, RecomputePolicy] = _f("option", "none")
    microbatches: int = _f("option", 1)
    virtual_stages: int = _f("option", 1)
    schedule: Optional[str] = _f("option", None)
    blocks_per_chunk: Optional[Tuple[int, ...]] = _f("option", None)
    fuse: bool = _f("option", False)
    compile: Union[bool, str] = _f("option", False)
    tp_comm_overlap: int = _f("option", 0)
    tp_comm_transport: str = _f("option", "auto")
    state_dict: Optional[Mapping[str, Any]] = _f("run", None)
    seed: int = _f("run", 0)
    verbose: bool = _f("run", False)
    grad_accum_dtype: Optional[torch.dtype] = _f("option", None)
    verify: bool = _f("run", False)
    min_split: float = _f("run", 0.5)
    chunked: bool = _f("option", False)     # the pipeline form at pp=1 (stage folders need it)
    cp_attention: str = _f("option", "ring")
    precision: str = _f("option", "bf16")
    fp8_recipe: str = _f("option", "tensorwise")
    fp8_policy: Union[str, Sequence[str], FP8Policy] = _f("option", "all")
    dp_shard: str = _f("option", "none")
    # hybrid sharding (HSDP): the dp ranks split into dp_replicate groups; each shards over its
    # dp / dp_replicate ranks (× cp) and the groups are replicas of each other
    dp_replicate: int = _f("option", 1)
    # expert parallelism, folded onto dp: each ep consecutive dp ranks hold E/ep whole experts of
    # every mixture-of-experts block and compute them for the tokens of all ep
    ep: int = _f("option", 1)
    # an MoE capacity factor: each expert keeps at most ceil(cf * T * k / E) of the assignments of a
    # rank's own tokens, the largest routing weights (None: dropless, the model's own semantics)
    moe_capacity_factor: Optional[float] = _f("option", None)

    def __post_init__(self):
        for name in DEGREES:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ShardingError(f"Layout({name}={v!r}): a degree is a whole number >= 1")
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
        if self.dp_shard not in DP_SHARD_MODES:
            raise ShardingError(f"parallelize(dp_shard={self.dp_shard!r}): expected one of {DP_SHARD_MODES}")
        if self.dp_shard == "full" and self.chunked:
            raise ShardingError("parallelize(dp_shard='full') of a chunked (compiled-folder) program: not built yet: "
                                "use dp_shard='optimizer'")
        if self.dp_shard == "full" and (self.precision == "fp8" or self.tp_comm_overlap):
            what = "precision='fp8'" if self.precision == "fp8" else f"tp_comm_overlap={self.tp_comm_overlap}"
            raise ShardingError(f"parallelize(dp_shard='full', {what}): not tested together yet (the gathered weights "
                                "would feed that pass's ops): use dp_shard='optimizer', or leave it off")
        if not isinstance(self.dp_replicate, int) or isinstance(self.dp_replicate, bool) or self.dp_replicate < 1:
            raise ShardingError(f"parallelize(dp_replicate={self.dp_replicate!r}): a number of replica groups >= 1")
        if self.dp_replicate > 1 and self.dp_shard == "none":
            raise ShardingError(f"parallelize(dp_replicate={self.dp_replicate}) replicates groups that shard "
                                "(hybrid sharding): give dp_shard='optimizer', 'gradients' or 'full'")
        if self.dp_replicate > 1 and self.dp > 1 and self.dp % self.dp_replicate:
            raise ShardingError(f"parallelize(dp_replicate={self.dp_replicate}): the {self.dp} data-parallel ranks "
                                f"do not split into {self.dp_replicate} equal groups")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ShardingError(f"parallelize(ep={self.ep!r}): a number of expert-parallel ranks >= 1")
        if self.ep > 1 and self.dp > 1 and self.dp % self.ep:
            raise ShardingError(f"parallelize(ep={self.ep}): expert parallelism folds onto the data-parallel ranks, "
                                f"and the {self.dp} of them do not split into groups of {self.ep}")
        if self.ep > 1 and self.dp_replicate > 1 and self.dp > 1 and self.dp // self.dp_replicate % self.ep:
            raise ShardingError(f"parallelize(ep={self.ep}, dp_replicate={self.dp_replicate}): an ep group must lie "
                                f"inside one replica group, and ep does not divide the {self.dp} data-parallel ranks "
                                f"/ {self.dp_replicate} groups = {self.dp // self.dp_replicate}")
        # ep composes with every other option: the sharded optimizer (each of the two gradient
        # reductions shards its own buckets), cp (an ep group at each cp rank, the experts' gradients
        # summed over the dp / ep ranks × cp), "full" (the experts sharded over those ranks, the dense
        # weights over dp × cp: rank_passes.expert_shards), dp_replicate (the ep groups inside a
        # replica group, the pieces summed over the groups) and FP8 (the linears are the dense ones,
        # each on its rank's own tokens; the experts' grouped GEMMs stay bf16)
        check_capacity_factor(self.moe_capacity_factor)
        if self.moe_capacity_factor is not None:
            # capacity counts the tokens of one forward of a block: a cp rank's would be its chunks of the
            # sequence, a sequence-parallel tp rank's its shard (not tested yet), pipeline chunks not
            # tested; verify's eager model runs dropless
            other = [f"{n}={getattr(self, n)!r}" for n, off in (("cp", 1), ("tp", 1), ("pp", 1), ("verify", False))
                     if getattr(self, n) != off]
            if other:
                raise ShardingError(f"parallelize(moe_capacity_factor={self.moe_capacity_factor}, {', '.join(other)}): "
                                    "not built together yet (the capacity is counted over a rank's tokens, tested "
                                    "with dp and ep; with microbatches over each microbatch's): leave one out")
        if self.cp_attention not in CP_ATTENTIONS:
            raise ShardingError(f"parallelize(cp_attention={self.cp_attention!r}): expected 'ring' or 'allgather'")
        if self.blocks_per_chunk is not None:
            object.__setattr__(self, "blocks_per_chunk", tuple(self.blocks_per_chunk))

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_axes(cls, axes: Mapping[str, Any], **options) -> "Layout":
        """The degrees from ``mesh.mesh_axes``'s axes (what ``parallelize`` reads), the rest from
        ``options`` (``parallelize``'s keywords)."""
        return cls(**{n: axes[n].size for n in DEGREES if n in axes}, **options)

    @classmethod
    def from_mesh(cls, mesh, **options) -> "Layout":
        """From a DeviceMesh (None: one process) and ``parallelize``'s keywords."""
        from fxmegatron.mesh import mesh_axes
        return cls.from_axes(mesh_axes(mesh, options.get("dp_replicate", 1), options.get("ep", 1)), **options)

    def with_degrees(self, axes: Mapping[str, Any]) -> "Layout":
        """This layout with the degrees of ``axes`` (an Axis per mesh dim)."""
        sizes = {n: axes[n].size for n in DEGREES if n in axes}
        return self if all(getattr(self, n) == s for n, s in sizes.items()) else dataclasses.replace(self, **sizes)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], **run) -> "Layout":
        """From the trainer's checked ``[layout]`` table (``train/config.py``; ``TOML_NAMES`` says
        where a key's name is not the field's, and an empty schedule or block list is the
        default), with ``run``'s fields (seed, state_dict, grad_accum_dtype) from elsewhere."""
        values = dict(run)
        for f in dataclasses.fields(cls):
            name = f.name
            if f.metadata["kind"] == "run":
                continue
            # a key left out holds its default (the config fills it in): not "given"
            keys = [k for k in (name, *TOML_ALIASES.get(name, ())) if k in table]
            keys = [k for k in keys if table[k] != TOML_EMPTY.get(name, f.default)]
            given = [table[k] for k in keys]
            if len(set(map(repr, given))) > 1:
                raise ShardingError(f"layout.{keys[0]} = {given[0]!r} and layout.{keys[1]} = {given[1]!r}: one "
                                    "option under two names; give one")
            if given:
                values[name] = given[0]
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser, degrees: Sequence[str] = DEGREES, options: Optional[Sequence[str]] = None) -> None:
        """A flag per layout option (``--sequence-parallel``, ``--tp-comm-overlap N``, ...; only
        those in ``options`` if given) and per degree in ``degrees`` on an argparse parser;
        ``from_args`` reads them back."""
        for f in dataclasses.fields(cls):
            kind = f.metadata["kind"]
            if (kind == "degree" and f.name not in degrees) or kind == "run" or f.name in CLI_LEFT_OUT or \
                    (kind == "option" and options is not None and f.name not in options):
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.default is False and f.name != "compile":
                parser.add_argument(flag, action="store_true")
            elif f.name == "compile":
                parser.add_argument(flag, nargs="?", const=True, default=False,
                                    help="torch.compile each rank's graph (optionally a mode)")
            elif f.name == "blocks_per_chunk":
                parser.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                                    help="blocks of each pipeline chunk, comma-separated")
            elif f.name == "moe_capacity_factor":
                parser.add_argument(flag, type=float, default=None, help="MoE capacity factor (default: dropless)")
            elif f.name == "grad_accum_dtype":
                parser.add_argument(flag, choices=("float32",), default=None,
                                    help="sum bf16/fp16 gradients over microbatches in this dtype")
            else:
                parser.add_argument(flag, type=type(f.default) if f.default is not None else str, default=f.default,
                                    choices=CLI_CHOICES.get(f.name))

    @classmethod
    def from_args(cls, args, **run) -> "Layout":
        """From what ``add_arguments``'s flags parsed to (``args``: an argparse Namespace)."""
        values = {n: getattr(args, n) for n in cls.fields_of("degree", "option") if hasattr(args, n)}
        if values.get("grad_accum_dtype") is not None:
            values["grad_accum_dtype"] = getattr(torch, values["grad_accum_dtype"])
        return cls(**values, **run)

    # ---- the schedule -----------------------------------------------------------------------------
    @property
    def recompute_name(self) -> str:
        r = self.recompute
        return r if isinstance(r, str) else getattr(r, "name", str(r))

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual_stages

    def pipelined(self, pp: Optional[int] = None) -> bool:
        """Whether the program is cut into chunks run by a schedule."""
        pp = self.pp if pp is None else pp
        return pp > 1 or self.virtual_stages > 1 or self.chunked

    def schedule_name(self, pp: Optional[int] = None) -> str:
        """The schedule the pipeline runs ("" without a pipeline)."""
        return (self.schedule or default_schedule(self.virtual_stages)) if self.pipelined(pp) else ""

    def make_schedule(self, pp: Optional[int] = None) -> Optional[Schedule]:
        """The pipeline schedule for a ``pp``-way pipeline (default: this layout's; None without
        one); checks the layout before the transformation."""
        pp = self.pp if pp is None else pp
        if self.pipelined(pp):
            return make_schedule(self.schedule_name(pp), pp, self.virtual_stages, self.microbatches)
        if self.schedule not in (None, "gpipe", "1f1b"):
            raise ScheduleError(f"schedule={self.schedule!r} needs a pipeline (a 'pp' mesh dim > 1 or "
                                "virtual_stages > 1)")
        return None

    # ---- how it reads -------------------------------------------------------------------------------
    @classmethod
    def fields_of(cls, *kinds: str) -> Tuple[str, ...]:
        """The names of the fields of these kinds ("degree", "option", "run"), in order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["kind"] in kinds)

    def options(self) -> Dict[str, Any]:
        """``parallelize``'s keywords that give this layout (the degrees come from the mesh)."""
        return {n: getattr(self, n) for n in self.fields_of("option", "run") if n != "chunked"}

    def changed(self) -> Dict[str, Any]:
        """The layout's options (not the run's) that differ from their defaults, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata["kind"] == "option" and getattr(self, f.name) != f.default}

    def describe(self) -> str:
        """One line: the degrees, then every option that is not its default (the pipeline's
        schedule always, where there is one)."""
        world = self.dp * self.pp * self.cp * self.tp
        parts = [" × ".join(f"{n} {getattr(self, n)}" for n in DEGREES) + f" = {world} ranks"]
        changed = self.changed()
        if self.pipelined():
            changed["schedule"] = self.schedule_name()
        for name, v in changed.items():
            if name == "recompute":
                v = self.recompute_name
            elif name == "grad_accum_dtype":
                v = str(v).replace("torch.", "")
            elif name == "fp8_policy" and not isinstance(v, str):
                if getattr(v, "name", None) == "all":
                    continue
                v = getattr(v, "name", None) or type(v).__name__
            elif name == "blocks_per_chunk":
                v = ",".join(map(str, v))
            parts.append(name if v is True else f"{name} {v}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return f"Layout({self.describe()})"


__all__ = ["Layout", "PRECISIONS", "CP_ATTENTIONS", "RECOMPUTE_MODES", "DEGREES", "SCHEDULE_NAMES",
           "default_schedule"]
