"""``parallelize`` and the object it returns."""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.capture import Captured, batch_args, capture
from fxmegatron.capture.inputs import check_batch
from fxmegatron.runtime.batch_check import check_same_batch
from fxmegatron.runtime.data_parallel import GradSync
from fxmegatron.runtime.grad_accumulation import Fp32GradAccumulator, check_grad_accum_dtype
from fxmegatron.io.dump import write_dump
from fxmegatron.errors import MeshError, ShardingError
from fxmegatron.runtime.torch_compile import check_compile_options, compile_graph
from fxmegatron.passes.dropout_rng import RNG_ATTR
from fxmegatron.passes.tp_coverage import coverage
from fxmegatron.passes.pipeline_split import Chunk, split_pipeline
from fxmegatron.passes.fuse import apply_fuse
from fxmegatron.passes.overlap_tp import apply_tp_overlap
from fxmegatron.ops.overlapped_linear import TRANSPORTS
from fxmegatron.passes.recompute import apply_recompute
from fxmegatron.passes.tensor_parallel import TPPlan
from fxmegatron.placement import Placement, R, join_shards
from fxmegatron.schedules import Schedule, ScheduleError, make_schedule
from fxmegatron.schedules.runtime import StageRunner
from fxmegatron.compiler import assemble_local, check_local_shapes, first_microbatch, transform_rank
from fxmegatron.runtime.stages import Stage, boundary_specs, build_stage, split_batch, token_counter

_KNOWN_DIMS = ("dp", "pp", "tp")
_SUPPORTED_DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Axis:
    """One mesh dimension as this rank sees it."""

    size: int = 1
    rank: int = 0
    group_name: str = ""
    ranks: Tuple[int, ...] = (0,)     # global ranks of the group, in group order

    @property
    def group(self):
        if not self.group_name:
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(self.group_name)


def _mesh_axes(mesh) -> Dict[str, Axis]:
    """{"dp": Axis, "pp": Axis, "tp": Axis} from a DeviceMesh, after checking it."""
    if mesh is None:
        return {"dp": Axis(), "tp": Axis(), "pp": Axis()}
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in _KNOWN_DIMS]
    if not names or unknown:
        raise MeshError(f"the device mesh has dims {names or '(unnamed)'}; fxmegatron needs dims named from "
                        f"{_KNOWN_DIMS}, e.g. 'tp' (init_device_mesh('cuda', (2,), mesh_dim_names=('tp',))) "
                        "or ('pp', 'tp')")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        raise MeshError(f"the device mesh {dict(zip(names, mesh.shape))} has {mesh.size()} devices but the "
                        f"world size is {world}: the mesh must cover every process")
    for n, s in zip(names, mesh.shape):
        if n not in _SUPPORTED_DIMS and s > 1:
            raise MeshError(f"mesh dim {n!r} of size {s} is not supported yet (supported: {_SUPPORTED_DIMS})")
    axes = {}
    for n in ("dp", "tp", "pp"):
        if n not in names:
            axes[n] = Axis()
            continue
        sub = mesh[n] if len(names) > 1 else mesh
        group = sub.get_group()
        axes[n] = Axis(sub.size(), sub.get_local_rank(), group.group_name,
                       tuple(dist.get_process_group_ranks(group)))
    return axes


def _runtime_device(mesh, model: Optional[nn.Module] = None) -> torch.device:
    if mesh is None:    # one process: where the model is (a meta model runs on the CPU)
        dev = next((p.device for p in model.parameters()), None) if model is not None else None
        return dev if dev is not None and dev.type != "meta" else torch.device("cpu")
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    if mesh.device_type == "meta":
        return torch.device("meta")
    return torch.device(mesh.device_type, torch.cuda.current_device())


@dataclass
class Pipeline:
    """What a pipelined ParallelModel runs: the schedule and this rank's stage."""

    schedule: Schedule
    chunks: List[Chunk]                 # every chunk, with meta parameters (for dumps and planning)
    stage: Stage
    runner: StageRunner


class ParallelModel(nn.Module):
    """One rank's piece of the parallel program.

    ``train_step(batch)`` runs forward and backward over the microbatches (the
    pipeline schedule when there is one) and returns the loss on every rank.
    Without pipeline parallelism the model can also be called with a batch to get
    the loss. ``parameters()`` are this rank's local shards, under the original
    model's names (tied weights appear once per rank).
    """

    def __init__(self, gm: Optional[fx.GraphModule], captured: Captured, plan: TPPlan, axes: Dict[str, Axis],
                 timings: Dict[str, float], microbatches: int = 1, pipeline: Optional[Pipeline] = None):
        super().__init__()
        self.graph_module = gm
        self._in_spec = captured.in_spec
        self._aliases = captured.aliases
        self._order = list(captured.params)
        # global (unsplit) shape and dtype of every parameter, for gathering and checkpoints
        self._global = {n: (tuple(t.shape), t.dtype) for n, t in captured.params.items()}
        self._plan = plan
        self._axes = axes
        self.tp_size, self.tp_rank, self._group_name = axes["tp"].size, axes["tp"].rank, axes["tp"].group_name
        self.pp_size, self.pp_rank = axes["pp"].size, axes["pp"].rank
        self.dp_size, self.dp_rank = axes["dp"].size, axes["dp"].rank
        self.microbatches = microbatches
        self._input_names = list(captured.input_names)
        # the first steps check that every tp and pp rank got the same batch (see check_same_batch)
        self.batch_checks = 3
        self.coverage = None            # how much tp splits (parallelize sets it)
        self.notes: List[str] = []      # what capture changed
        self._grad_sync: Optional[GradSync] = None
        self._grad_accum: Optional[Fp32GradAccumulator] = None
        self._count_tokens = None       # flat microbatch -> tokens its loss averages over
        self._holders: Dict[str, int] = {}   # weight -> number of pipeline stages holding it
        if pipeline is not None:
            ranks: Dict[str, set] = {}
            for c in pipeline.chunks:
                for name in c.params:
                    ranks.setdefault(name, set()).add(c.index % pipeline.schedule.p)
            self._holders = {n: len(r) for n, r in ranks.items()}
        self.timings = timings
        self._recompute = "none"
        self._pipeline = pipeline
        if pipeline is not None:
            self.stages = nn.ModuleDict({str(k): m for k, m in pipeline.stage.modules.items()})

    # parameters keep the original model's names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        if self._pipeline is None:
            yield from self.graph_module.named_parameters(prefix, recurse, remove_duplicate)
            return
        params = self._pipeline.stage.params
        for name in self._order:
            if name in params:
                yield (prefix + "." + name if prefix else name), params[name]

    def placement(self, name: str) -> Placement:
        """How parameter ``name`` (original model's name) is split over tp."""
        return self._plan.param_plc.get(self._aliases.get(name, name), R)

    def _flat(self, args, kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list, dict)):
            args, kwargs = batch_args(args[0])
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise TypeError(f"batch structure {spec} differs from the example batch's {self._in_spec}")
        if self.batch_checks > 0:
            self.batch_checks -= 1
            check_same_batch(flat, self._input_names, self._axes)
        return flat

    def _check_micro(self, micro, what):
        check_batch(micro, self._example_inputs, self._input_names, what)

    @property
    def dp_group(self):
        """The data-parallel process group (None without a "dp" dim), e.g. for
        ``torch.distributed.optim.ZeroRedundancyOptimizer(..., process_group=pm.dp_group)``."""
        return self._axes["dp"].group

    def forward(self, *args, **kwargs):
        if self._pipeline is not None:
            raise RuntimeError("a pipelined model runs whole steps: call train_step(batch) (forward and backward "
                               "over the microbatches by the schedule)")
        if self.dp_size > 1:
            raise RuntimeError("with data parallelism, call train_step(batch) with the global batch: it takes this "
                               "rank's share and averages gradients over dp")
        flat = self._flat(args, kwargs)
        self._check_micro(flat, "batch")
        return self.graph_module(*flat)[0]

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of one batch, split into ``microbatches``; gradients accumulate
        in ``.grad`` (the optimizer step is the caller's). Returns the batch's loss (detached),
        on every rank: each microbatch's loss is weighted 1/m, which is the whole batch's mean
        loss when the model's loss is a mean over equal microbatches."""
        flat = self._flat(args, kwargs)
        m = self.microbatches
        names = [f"input {i}" for i in range(len(flat))]
        if self.dp_size > 1:    # this data-parallel rank's share of the global batch
            flat = split_batch(flat, self.dp_size, names, f"dp={self.dp_size}")[self.dp_rank]
        micro = split_batch(flat, m, names)
        self._check_micro(micro[0], f"microbatch (the batch split over dp={self.dp_size} and m={m})"
                          if m * self.dp_size > 1 else "batch")
        weights = self._loss_weights(micro)
        if self._grad_accum is not None:
            self._grad_accum.start(m)
        if self._grad_sync is not None:
            self._grad_sync.start(m)
        if self._pipeline is None:
            total = None
            for mb, w in zip(micro, weights):
                loss = self.graph_module(*mb)[0]
                (loss * w).backward()
                total = loss.detach() * w if total is None else total + loss.detach() * w
        else:
            total = self._pipeline.runner.run(micro, weights)
        if self._grad_accum is not None:
            self._grad_accum.finish()
        if self._grad_sync is not None:
            self._grad_sync.finish()
        if self._pipeline is not None:
            self._sum_shared_grads()
            total = self._broadcast_loss(total)
        if self.dp_size > 1:
            total = total.detach().float().clone()
            dist.all_reduce(total, group=self.dp_group)
            total /= self.dp_size
        return total

    def _loss_weights(self, micro) -> List[float]:
        """Weight of each microbatch's (mean) loss so that the step's loss is the mean over
        every counted token of the global batch: count_i·dp / N (1/m without a counter)."""
        m = len(micro)
        if self._count_tokens is None:
            return [1.0 / m] * m
        counts = [float(self._count_tokens(mb)) for mb in micro]
        # on the device the process group's backend serves (NCCL takes no CPU tensors)
        dev = next((p.device for p in self.parameters()), torch.device("cpu"))
        total = torch.tensor(sum(counts), dtype=torch.float64, device=dev)
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
        total = total.item()
        if total == 0:
            return [1.0 / m] * m
        return [c * self.dp_size / total for c in counts]

    def grad_norm(self) -> torch.Tensor:
        """The norm of the whole (unsplit) model's gradient, as ``torch.nn.utils.clip_grad_norm_``
        on the unmodified model computes it (fp32, on the device, no host sync). Collective over
        tp and pp (every rank must call it)."""
        dev = next((p.device for p in self.parameters()), torch.device("cpu"))
        # a gradient held whole by each of the tp ranks, or by several pipeline stages, counts
        # once: its square is divided by its number of holders
        by_holders: Dict[int, List[torch.Tensor]] = {}
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            holders = (self.tp_size if self.placement(name) == R else 1) * self._holders.get(name, 1)
            by_holders.setdefault(holders, []).append(p.grad.detach())
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        for holders, grads in by_holders.items():
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            sq += torch.stack(norms).square().sum() / holders
        for dim in ("tp", "pp"):
            if self._axes[dim].size > 1:
                dist.all_reduce(sq, group=self._axes[dim].group)
        return sq.sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that the norm of the whole (unsplit) model's gradient is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` on the unmodified model would; returns
        that norm. Collective over tp and pp (every rank must call it). With
        ``fxmegatron.optim.FusedAdamW``, ``opt.step(clip_coefficient(pm.grad_norm(), max_norm))``
        does the same without this pass over the gradients."""
        from fxmegatron.optim import clip_coefficient
        norm = self.grad_norm()
        coef = clip_coefficient(norm, max_norm)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        # the coefficient in the gradients' dtype: a mixed-dtype _foreach_mul_ falls back to
        # one kernel per tensor (as torch's clip, which computes its norm in that dtype)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))
        return norm

    def _sum_shared_grads(self) -> None:
        """Weights used on several pipeline ranks (a tied embedding and LM head): sum their
        gradients over the pipeline group, as the unmodified model sums both uses."""
        shared = self._pipeline.stage.shared
        if not shared or self.pp_size == 1:
            return
        params = self._pipeline.stage.params
        dev = self._pipeline.runner.device
        flat = []
        for name, (shape, dtype) in shared.items():
            p = params.get(name)
            g = p.grad if p is not None and p.grad is not None else torch.zeros(shape, dtype=dtype, device=dev)
            flat.append(g.reshape(-1))
        buf = torch.cat(flat)
        dist.all_reduce(buf, group=self._axes["pp"].group)
        off = 0
        for name, (shape, dtype) in shared.items():
            n = math.prod(shape)
            p = params.get(name)
            if p is not None:
                p.grad = buf[off:off + n].view(shape).clone()
            off += n

    def _broadcast_loss(self, total: Optional[torch.Tensor]) -> torch.Tensor:
        if self.pp_size == 1:
            return total
        ax = self._axes["pp"]
        t = total.float().reshape(()) if total is not None else torch.zeros((), device=self._pipeline.runner.device)
        dist.broadcast(t, src=ax.ranks[-1], group=ax.group)
        return t

    # ---- gathering shards ------------------------------------------------------
    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        plc = self.placement(name)
        if self.tp_size == 1 or plc == R:
            return local.detach().clone()
        pg = self._axes["tp"].group
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.detach().contiguous(), group=pg)
        return join_shards(parts, plc)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Whole parameters under every name the unmodified model uses, tied names
        included, on every rank: loads into the unmodified model with strict=True.
        Collective over tp and pp: every rank must call it."""
        out = {n: self._gather(n, p) for n, p in self.named_parameters()}
        if self._pipeline is not None and self.pp_size > 1:
            out = self._gather_stages(out)
        for alias, canon in self._aliases.items():
            if canon in out:
                out[alias] = out[canon]
        return out

    def _gather_stages(self, mine: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Each parameter broadcast over pp from the first stage that holds it."""
        ax = self._axes["pp"]
        holder: Dict[str, int] = {}
        for c in self._pipeline.chunks:
            for name in c.params:
                if name in self._global:
                    holder[name] = min(holder.get(name, ax.size), c.index % ax.size)
        dev = self._pipeline.runner.device
        out = {}
        for name in self._order:
            shape, dtype = self._global[name]
            t = mine[name].to(dev) if name in mine else torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(t, src=ax.ranks[holder[name]], group=ax.group)
            out[name] = t
        return out

    def full_grads(self) -> Dict[str, torch.Tensor]:
        """Whole gradients of this rank's parameters (collective over tp)."""
        return {n: self._gather(n, p.grad) for n, p in self.named_parameters() if p.grad is not None}

    def dump(self, directory: str) -> None:
        """Write this rank's transformed graph(s), placements, collectives and decisions."""
        info = {"dp": f"{self.dp_size} (rank {self.dp_rank})",
                "tp": f"{self.tp_size} (rank {self.tp_rank})",
                "pp": f"{self.pp_size} (rank {self.pp_rank})",
                "sequence parallel": str(self._plan.sequence_parallel),
                "recompute": str(self._recompute),
                "microbatches": str(self.microbatches),
                "planning attempts": str(self._plan.attempts)}
        for name, why in self._plan.replicated_params.items():
            info[f"kept replicated: {name}"] = why
        if self.coverage is not None:
            info["split"] = self.coverage.summary(top=10)
        for i, note in enumerate(self.notes):
            info[f"capture note {i}"] = note
        root = f"{directory}/rank{dist.get_rank() if dist.is_initialized() else 0}"
        if self._pipeline is None:
            write_dump(root, self.graph_module, info)
            return
        sched = self._pipeline.schedule
        info["schedule"] = f"{sched.name} p={sched.p} v={sched.v} m={sched.m}"
        for c in self._pipeline.chunks:
            info[f"chunk {c.index}"] = (f"rank {c.index % sched.p}; units {c.units[0]} .. {c.units[-1]} "
                                        f"({len(c.units)}); cost {c.cost:.3g}; sends {c.boundary_out}")
        info["actions"] = " ".join(str(a) for a in sched.ranks[self.pp_rank])
        for k, mod in self._pipeline.stage.modules.items():
            write_dump(f"{root}/chunk{k}", mod, info)


def parallelize(model: nn.Module, mesh, example_batch, *, sequence_parallel: bool = False,
                recompute="none", microbatches: int = 1, virtual_stages: int = 1,
                schedule: Optional[str] = None, blocks_per_chunk: Optional[Sequence[int]] = None,
                fuse: bool = False, compile=False, tp_comm_overlap: int = 0, tp_comm_transport: str = "auto",
                state_dict: Optional[Mapping] = None, seed: int = 0, verbose: bool = False,
                grad_accum_dtype: Optional[torch.dtype] = None, verify: bool = False, min_split: float = 0.5,
                _chunked: bool = False) -> ParallelModel:
    """Trace ``model`` on ``example_batch`` and return this rank's parallel piece.

    ``mesh``: a torch DeviceMesh with dims named "tp" and/or "pp" (or None: one process).
    ``example_batch``: what ``model`` is called with (tuple -> positional, dict ->
    keyword); its forward must return the loss. ``sequence_parallel``: norms, dropout
    and residual adds run on sequence shards between tensor-parallel regions (g becomes
    a reduce-scatter, f an all-gather). ``recompute``: "none", "selective" (attention
    core), "full" (each transformer block) or a ``RecomputePolicy``.
    Pipeline: the graph is cut into pp·``virtual_stages`` chunks at transformer blocks
    (balanced by cost, or ``blocks_per_chunk``), chunk c on pp rank c % pp, run by
    ``schedule`` ("gpipe", "1f1b", "interleaved"; default 1f1b, or interleaved when
    virtual_stages > 1) over ``microbatches`` per ``train_step``.
    ``fuse``: each run of elementwise ops becomes one generated Triton kernel (forward, and a
    backward that recomputes the run); without CUDA the runs execute as the original ops.
    ``tp_comm_overlap``: with sequence parallelism, each all-gather and reduce-scatter runs
    merged with its linears, cut into this many pieces along the batch, so that a piece's
    communication overlaps the previous piece's matmuls (0: off; see
    ``fxmegatron.ops.overlapped_linear``). ``tp_comm_transport``: what moves those pieces:
    "copy_engine" (the GPU's copy engines, through symmetric memory: no SMs taken from the
    matmuls; ``fxmegatron.ops.copy_engine``), "nccl" (the process group's collectives), or
    "auto" (copy engines where the group has them, else the process group). Over copy
    engines the pieces are the tp ranks' sequence slices instead (a ring that starts
    with the rank's own slice), whatever the number of pieces asked for.
    ``compile``: each rank's graph (or pipeline chunk) goes to torch.compile after the passes
    (True, or a torch.compile mode string); inductor then generates the kernels.
    Weights come from ``state_dict``, else from the model, else (meta model) are
    initialised shard by shard. ``seed``: for that initialisation and
    for dropout masks (counter-based, keyed by element index: see ``fxmegatron.ops.dropout``).
    ``grad_accum_dtype``: torch.float32 sums the gradients of bf16/fp16 parameters over a
    step's microbatches (and pipeline chunks) in fp32, rounding once at the end (Megatron's
    main_grad; ``fxmegatron.runtime.grad_accumulation``); None (default) lets autograd accumulate in
    the parameters' dtype.
    ``verify``: before transforming, check the tensor-parallel layout (tp, sequence parallelism,
    recompute) against the model in eager on simulated ranks in this process
    (``fxmegatron.verify``; needs the model's real weights, so use it with a tiny config).
    ``min_split``: at tp > 1, warn (naming the modules) when less than this share of the
    matmul FLOPs is split; ``pm.coverage`` and the dump's plan.txt always say how much is.
    """
    axes = _mesh_axes(mesh)
    tp, pp, dp = axes["tp"], axes["pp"], axes["dp"]
    check_compile_options(compile, fuse)
    check_grad_accum_dtype(grad_accum_dtype)
    if tp_comm_overlap and not sequence_parallel:
        raise ShardingError(f"parallelize(tp_comm_overlap={tp_comm_overlap}) overlaps sequence parallelism's "
                            "all-gathers and reduce-scatters with matmuls: it needs sequence_parallel=True")
    if not isinstance(tp_comm_overlap, int) or tp_comm_overlap < 0:
        raise ShardingError(f"parallelize(tp_comm_overlap={tp_comm_overlap!r}): expected a number of batch "
                            "pieces >= 0 (0: off)")
    if tp_comm_transport not in TRANSPORTS:
        raise ShardingError(f"parallelize(tp_comm_transport={tp_comm_transport!r}): expected one of {TRANSPORTS}")
    pipelined = pp.size > 1 or virtual_stages > 1 or _chunked
    sched = None
    if pipelined:   # check the layout before the (long) transformation
        sched = make_schedule(schedule or ("interleaved" if virtual_stages > 1 else "1f1b"),
                              pp.size, virtual_stages, microbatches)
    elif schedule not in (None, "gpipe", "1f1b"):
        raise ScheduleError(f"schedule={schedule!r} needs a pipeline (a 'pp' mesh dim > 1 or virtual_stages > 1)")
    device = _runtime_device(mesh, model)
    if verify:
        _verify_first(model, example_batch, tp.size, sequence_parallel, recompute, seed)
    timings = {}
    t0 = time.perf_counter()
    cap = capture(model, first_microbatch(example_batch, microbatches, dp.size))
    timings["capture_s"] = time.perf_counter() - t0
    gm = cap.gm
    t0 = time.perf_counter()
    plan = transform_rank(gm, cap, tp.size, tp.rank, tp.group_name, sequence_parallel, seed, dp.rank)
    cov = coverage(gm, plan, cap.params)    # after the rewrite, before shapes become local
    timings["tensor_parallel_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    local = assemble_local(gm, cap, plan, tp.rank, tp.size, "meta" if pipelined else device, state_dict, seed)
    timings["materialize_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    check_local_shapes(local, cap)
    if hasattr(local, RNG_ATTR):
        getattr(local, RNG_ATTR).step = 0   # the shape check ran one forward
    timings["shape_check_s"] = time.perf_counter() - t0
    if tp_comm_overlap and tp.size > 1:
        apply_tp_overlap(local, tp_comm_overlap, tp_comm_transport)
    apply_recompute(local, recompute)
    if fuse:
        apply_fuse(local)
    mode = compile if isinstance(compile, str) else None
    pipe = None
    if pipelined:
        t0 = time.perf_counter()
        chunks = split_pipeline(local, pp.size * virtual_stages, blocks_per_chunk=blocks_per_chunk)
        placeholders = [n.meta["val"] for n in local.graph.nodes if n.op == "placeholder"]
        specs = boundary_specs(chunks, placeholders)
        stage = build_stage(chunks, pp.size, pp.rank, cap, plan.param_plc, tp.rank, tp.size, device,
                            state_dict, seed, local)
        if compile:
            for m in stage.modules.values():
                compile_graph(m, mode)
        runner = StageRunner(sched, pp.rank, stage.modules, {c.index: c.batch_inputs for c in chunks}, specs,
                             pp.ranks, pp.group, device)
        pipe = Pipeline(sched, chunks, stage, runner)
        timings["pipeline_s"] = time.perf_counter() - t0
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print("fxmegatron: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()), flush=True)
    if compile and not pipelined:
        compile_graph(local, mode)
    pm = ParallelModel(None if pipelined else local, cap, plan, axes, timings, microbatches, pipe)
    if pipelined:
        pm._meta = [local]   # a plain list: not a submodule, its parameters are meta
    pm._recompute = recompute if isinstance(recompute, str) else getattr(recompute, "name", str(recompute))
    pm._seed = seed
    pm.coverage = cov
    pm.notes = list(cap.notes)
    _warn_coverage(cov, min_split)
    if microbatches > 1 or dp.size > 1:
        pm._count_tokens = token_counter(local, device)
    pm._example_inputs = [n.meta["val"] for n in local.graph.nodes if n.op == "placeholder"]
    uses = chunk_uses(pipe.chunks, pipe.stage.modules, pipe.stage.params) if pipe is not None else {}
    attach_grad_hooks(pm, uses, dp, grad_accum_dtype)
    return pm


def _verify_first(model, example_batch, tp, sequence_parallel, recompute, seed) -> None:
    import copy

    from fxmegatron.verify import verify as check
    # simulated ranks run on the CPU (verify refuses a meta model itself)
    on_cpu = all(p.device.type in ("cpu", "meta") for p in model.parameters())
    cpu = model if on_cpu else copy.deepcopy(model).cpu()
    report = check(cpu, pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), example_batch), tp=tp,
                   sequence_parallel=sequence_parallel, recompute=recompute, seed=seed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"fxmegatron: {report}", flush=True)


def _warn_coverage(cov, min_split: float) -> None:
    if cov.tp > 1 and cov.flops_split < min_split and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"fxmegatron: only {cov.flops_split:.0%} of the matmul FLOPs are split over tp={cov.tp} "
                      f"(min_split={min_split:.0%}): the largest replicated ones are\n"
                      + "\n".join(f"  {w} ({f:.1%}): {why}" for w, f, why in cov.replicated[:5]), stacklevel=3)


def chunk_uses(chunks: Sequence[Chunk], modules: Mapping, params: Mapping) -> Dict[int, int]:
    """id(parameter) -> how many of this rank's chunks use it: its gradient accumulations per
    microbatch (each chunk's backward is a separate one)."""
    uses: Dict[int, int] = {}
    for c in chunks:
        if c.index in modules:
            for name in c.params:
                if name in params:
                    k = id(params[name])
                    uses[k] = uses.get(k, 0) + 1
    return uses


def attach_grad_hooks(pm: ParallelModel, uses: Dict[int, int], dp: Axis, grad_accum_dtype=None) -> None:
    """The fp32 accumulation (when asked for) first, then the data-parallel averaging: the
    hooks run in that order, so a bucket reduced at a parameter's last accumulation holds
    the rounded fp32 sum."""
    if grad_accum_dtype is not None and (pm.microbatches > 1 or any(v > 1 for v in uses.values())):
        pm._grad_accum = Fp32GradAccumulator(list(pm.parameters()), uses)
    if dp.size > 1:
        pm._grad_sync = GradSync(list(pm.parameters()), uses, dp.group, dp.size)
