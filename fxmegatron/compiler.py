"""The compiler: a model and a layout in, one rank's ``RankProgram`` out.

``compile_program`` is the whole flow, one direction: capture, the graph passes (a flat
list run by ``passes.runner.PassRunner``), the pipeline split, and one materialisation of
this rank's shards at the end. Until then the rank's graph holds meta tensors of the local
shapes, so every pass sees consistent shapes and nothing is allocated.
"""
from __future__ import annotations

import time
from typing import List, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.capture import Captured, capture
from fxmegatron.config import ParallelConfig
from fxmegatron.errors import LossError, ScheduleError, ShardingError
from fxmegatron.lower.materialize import materialize_graph
from fxmegatron.lower.stages import boundary_specs, build_stage, token_counter
from fxmegatron.lower.torch_compile import compile_graph
from fxmegatron.mesh import Axis
from fxmegatron.passes.attention_rewrites import attention_rewrites
from fxmegatron.passes.context_parallel import apply_context_parallel
from fxmegatron.passes.dropout_rng import apply_counter_rng
from fxmegatron.passes.loss_grad_in_place import loss_grad_reuses_logits
from fxmegatron.passes.loss_terms import check_split_loss, split_by
from fxmegatron.passes.loss_upcast import loss_reads_logits_dtype
from fxmegatron.passes.fp8 import apply_fp8
from fxmegatron.passes.fp8_gather import gather_in_fp8
from fxmegatron.passes.fp8_share import share_fp8_quantization
from fxmegatron.passes.fuse import apply_fuse
from fxmegatron.passes.gelu_for_inductor import gelu_tanh_through_sigmoid
from fxmegatron.passes.gelu_formula import gelu_formula_to_op
from fxmegatron.passes.gemm_epilogues import apply_gemm_epilogues
from fxmegatron.passes.overlap_tp import apply_tp_overlap
from fxmegatron.passes.pipeline_split import split_pipeline
from fxmegatron.passes.recompute import apply_recompute
from fxmegatron.passes.runner import Pass, PassRunner, check_shapes
from fxmegatron.passes.tensor_parallel import TPPlan, apply_tensor_parallel, plan_tensor_parallel
from fxmegatron.passes.tp_coverage import coverage
from fxmegatron.passes.trivial_collectives import drop_trivial_collectives
from fxmegatron.program import PipelineProgram, RankProgram
from fxmegatron.runtime.id_check import id_checker
from fxmegatron.runtime.microbatches import split_batch

PLAN, COVERAGE = "fxmegatron/tp_plan", "fxmegatron/tp_coverage"   # keys in GraphModule.meta
# the passes name a collective's group by its mesh axis; materialisation binds it
TP_AXIS = "@tp"
CP_AXIS = "@cp"
# data-parallel replicas see different samples: their dropout masks must differ too
DP_SEED_STRIDE = 0x9E3779B1


def tp_passes(cap: Captured, tp: int, tp_rank: int, group_name: str, sequence_parallel: bool,
              seed: int, dp_rank: int = 0) -> List[Pass]:
    """The passes that make one tensor-parallel rank's graph from the captured one: placement
    planning and the rewrite with f/g and sequence collectives on ``group_name`` (the plan
    and its coverage land in ``gm.meta``), and counter-based dropout."""
    def tensor_parallel(gm):
        plan = plan_tensor_parallel(gm, tp, cap.params.keys(), sequence_parallel)
        apply_tensor_parallel(gm, plan, tp_rank, group_name)
        gm.meta[PLAN] = plan
        gm.meta[COVERAGE] = coverage(gm, plan, cap.params)   # before shapes become local
        return gm

    passes = [Pass("tensor_parallel", tensor_parallel, ensures={"tp_rewritten"})]
    passes.append(Pass("loss_reads_logits_dtype", loss_reads_logits_dtype, requires={"tp_rewritten"}))
    passes.append(Pass("loss_grad_reuses_logits", lambda gm: loss_grad_reuses_logits(gm, tp),
                       requires={"tp_rewritten"}))
    passes.append(Pass("attention_rewrites", attention_rewrites, requires={"tp_rewritten"}))
    if tp == 1:
        passes.append(Pass("drop_trivial_collectives", drop_trivial_collectives, requires={"tp_rewritten"}))
    passes.append(Pass("counter_rng", lambda gm: apply_counter_rng(gm, tp_rank, tp, seed + DP_SEED_STRIDE * dp_rank),
                       requires={"tp_rewritten"}))
    return passes


def assemble_local(gm: fx.GraphModule, cap: Captured, plan: TPPlan, rank: int, world: int, device,
                   state_dict: Optional[Mapping] = None, seed: int = 0) -> fx.GraphModule:
    """The rank's GraphModule: its parameter shards, buffers and submodules, on ``device``."""
    local = materialize_graph(gm, cap, plan.param_plc, rank, world, device, state_dict, seed, source=gm)
    local.meta.update(gm.meta)
    return local


def check_local_shapes(gm: fx.GraphModule) -> fx.GraphModule:
    """Propagate fake tensors with the local shards: shapes of the rewritten graph must be
    consistent, and each node ends up with its local value in meta["val"]."""
    try:
        check_shapes(gm)
    except Exception as exc:
        raise ShardingError(f"the tensor-parallel graph is inconsistent: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return gm


def cp_passes(cap: Captured, cp: Axis, variant: str) -> List[Pass]:
    """Context parallelism, on the captured graph before tensor parallelism: attention's
    causal mask proved and dropped first (cp attention runs causal or full attention),
    then the graph cut to this rank's part of the sequence, and its shapes propagated."""
    if cp.size == 1:
        return []
    return [Pass("attention_rewrites", attention_rewrites),
            Pass("context_parallel", lambda gm: apply_context_parallel(gm, cp.size, cp.rank, CP_AXIS,
                                                                       cap.params.keys(), variant)),
            Pass("cp_local_shapes", check_local_shapes)]


def rank_passes(cap: Captured, axes: Mapping[str, Axis], cfg: ParallelConfig, device=None) -> List[Pass]:
    """Every graph pass of a rank, in order. After ``localize`` the graph holds meta shards.
    Collectives name the tp and cp axes (``TP_AXIS``, ``CP_AXIS``), not process groups: see
    ``groups``. ``device``: where the program runs (None: not known, as for planning; the
    passes that only pay off on one kind of device are left out)."""
    tp = axes["tp"]
    passes = cp_passes(cap, axes.get("cp", Axis()), cfg.cp_attention)
    passes += tp_passes(cap, tp.size, tp.rank, TP_AXIS, cfg.sequence_parallel, cfg.seed, axes["dp"].rank)
    passes += [
        Pass("localize", lambda gm: assemble_local(gm, cap, gm.meta[PLAN], tp.rank, tp.size, "meta"),
             requires={"tp_rewritten"}),
        Pass("check_local_shapes", check_local_shapes, ensures={"local_shapes"}),
    ]
    if cfg.precision == "fp8":
        # on local shapes (the alignment check sees each rank's GEMMs) and the rewrite's placements
        # (which dim the ranks split: the amax reductions); before recompute and fuse
        group = TP_AXIS if tp.size > 1 else ""
        passes.append(Pass("fp8", lambda gm: apply_fp8(gm, cfg.fp8_policy, cfg.fp8_recipe, group),
                           requires={"local_shapes"}, ensures={"fp8"}))
        passes.append(Pass("fp8_share", share_fp8_quantization, requires={"fp8"}))
        # sequence gathers that only FP8 linears read move FP8 bytes (before tp_overlap claims them)
        passes.append(Pass("fp8_gather", gather_in_fp8, requires={"fp8"}))
    if cfg.tp_comm_overlap and tp.size > 1:
        passes.append(Pass("tp_overlap", lambda gm: apply_tp_overlap(gm, cfg.tp_comm_overlap, cfg.tp_comm_transport),
                           requires={"local_shapes"}))
    passes.append(Pass("recompute", lambda gm: apply_recompute(gm, cfg.recompute), requires={"local_shapes"}))
    compiled_on_cuda = cfg.compile and device is not None and torch.device(device).type == "cuda"
    if cfg.compile:     # a written-out tanh GeLU, as one op for the GeLU passes below
        passes.append(Pass("gelu_formula", gelu_formula_to_op, requires={"local_shapes"}))
    if compiled_on_cuda:    # before fuse: a GeLU in a GEMM's epilogue is not a fused group's
        passes.append(Pass("gemm_epilogues", apply_gemm_epilogues, requires={"local_shapes"}))
    if cfg.fuse:
        passes.append(Pass("fuse", lambda gm: apply_fuse(gm, beside_inductor=bool(cfg.compile)),
                           requires={"local_shapes"}))
    if cfg.compile:     # after fuse: a GeLU a fused group took is not rewritten
        passes.append(Pass("gelu_for_inductor", gelu_tanh_through_sigmoid, requires={"local_shapes"}))
    return passes


def compile_program(model: nn.Module, example_batch, axes: Mapping[str, Axis], device,
                    cfg: ParallelConfig, debug: bool = False) -> RankProgram:
    """This rank's program. ``debug``: the fake shape check after every pass. (``parallelize``
    has checked the layout before it comes here.)"""
    t0 = time.perf_counter()
    cap = capture(model, first_microbatch(example_batch, cfg.microbatches, axes["dp"].size))
    return compile_captured(cap, axes, device, cfg, debug, {"capture_s": time.perf_counter() - t0})


def compile_captured(cap: Captured, axes: Mapping[str, Axis], device, cfg: ParallelConfig, debug: bool = False,
                     timings: Optional[dict] = None) -> RankProgram:
    """The rank's program from a capture (whose graph it transforms in place: give each rank
    its own copy). ``fxmegatron.verify`` builds every simulated rank through this."""
    tp, pp, dp = axes["tp"], axes["pp"], axes["dp"]
    sched = cfg.make_schedule(pp.size)
    split = cfg.microbatches > 1 or dp.size > 1
    check_split_loss(cap.gm, cfg.microbatches, dp.size)     # before the passes rewrite the loss
    check_ids = id_checker(cap.gm, cap.input_names, device)  # the whole vocabulary: before tp splits it
    timings = dict(timings or {})
    runner = PassRunner(rank_passes(cap, axes, cfg, device), debug=debug)
    local = runner(cap.gm)
    timings.update({f"{name}_s": s for name, s in runner.timings.items()})
    plan = local.meta[PLAN]
    placeholders = tuple(n.meta["val"] for n in local.graph.nodes if n.op == "placeholder")
    mode = cfg.compile if isinstance(cfg.compile, str) else None
    t0 = time.perf_counter()
    gm, pipe = None, None
    if sched is None:
        gm = materialize_graph(local, cap, plan.param_plc, tp.rank, tp.size, device, cfg.state_dict, cfg.seed,
                               source=cap.gm, groups=groups(axes))
        if cfg.compile:
            compile_graph(gm, mode)
    else:
        chunks = split_pipeline(local, pp.size * cfg.virtual_stages, blocks_per_chunk=cfg.blocks_per_chunk)
        specs = boundary_specs(chunks, placeholders)
        stage = build_stage(chunks, pp.size, pp.rank, cap, plan.param_plc, tp.rank, tp.size, device,
                            cfg.state_dict, cfg.seed, local, source=cap.gm, groups=groups(axes))
        if cfg.compile:
            for m in stage.modules.values():
                compile_graph(m, mode)
        pipe = PipelineProgram(sched, tuple(chunks), stage, specs)
    timings["materialize_s"] = time.perf_counter() - t0
    counter = token_counter(local, device)
    count = counter if split else None      # unsplit, no count to make each step
    if split and count is None:
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
        count_tokens=count, token_count=counter, check_ids=check_ids, coverage=local.meta[COVERAGE],
        notes=tuple(cap.notes), timings=timings)


def groups(axes: Mapping[str, Axis]) -> dict:
    """The binding of the passes' axis names to this rank's process groups."""
    return {TP_AXIS: axes["tp"].group_name, CP_AXIS: axes.get("cp", Axis()).group_name}


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
