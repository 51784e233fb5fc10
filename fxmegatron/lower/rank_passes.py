"""The graph passes of one rank, in order (``rank_passes``): context parallelism, the
tensor-parallel rewrite, counter-based dropout, the meta shards of the local shapes, then the
optional passes a layout asks for (fp8, tp_comm_overlap, recompute, fuse, the compile helpers).

Collectives name the tp and cp axes (``TP_AXIS``, ``CP_AXIS``), not process groups;
``groups`` binds them to a rank's groups when it is materialised. ``layout`` is a
``fxmegatron.layout.Layout`` (read by attribute: the layout module sits above this layer).
"""
from __future__ import annotations

from typing import List, Mapping, Optional

import torch
import torch.fx as fx

from fxmegatron.capture import Captured
from fxmegatron.errors import LossError, ShardingError
from fxmegatron.lower.materialize import materialize_graph
from fxmegatron.lower.overlap_scheduler import scheduler_wraps_nodes
from fxmegatron.mesh import Axis
from fxmegatron.passes import batch_term
from fxmegatron.passes.attention_kernel import fused_attention_kernel
from fxmegatron.passes.attention_rewrites import attention_rewrites
from fxmegatron.passes.context_parallel import apply_context_parallel
from fxmegatron.passes.dp_shard import shard_parameters
from fxmegatron.passes.dropout_rng import apply_counter_rng
from fxmegatron.passes.expert_parallel import check_divisible, find_experts
from fxmegatron.passes.expert_parallel.capacity import apply_capacity
from fxmegatron.passes.expert_parallel.rewrite import apply_expert_parallel, check_supported, expert_params
from fxmegatron.passes.expert_parallel.trail import ancestors
from fxmegatron.passes.fp8 import apply_fp8
from fxmegatron.passes.fp8_gather import gather_in_fp8
from fxmegatron.passes.fp8_share import share_fp8_quantization
from fxmegatron.passes.fuse import apply_fuse
from fxmegatron.passes.gelu_for_inductor import gelu_tanh_through_sigmoid
from fxmegatron.passes.gelu_formula import gelu_formula_to_op
from fxmegatron.passes.gemm_epilogues import apply_gemm_epilogues
from fxmegatron.passes.loss_grad_in_place import loss_grad_in_graph, loss_grad_reuses_logits
from fxmegatron.passes.loss_terms import added_term, split_loss_problem
from fxmegatron.passes.loss_upcast import loss_reads_logits_dtype
from fxmegatron.passes.merge_linears import merge_linears
from fxmegatron.passes.overlap_tp import apply_tp_overlap
from fxmegatron.passes.recompute import RecomputePolicy, apply_recompute
from fxmegatron.passes.runner import Pass, check_shapes
from fxmegatron.passes.slice_writes import slice_writes_to_cat
from fxmegatron.passes.tables_once import compute_tables_once
from fxmegatron.passes.tensor_parallel import TPPlan, apply_tensor_parallel, plan_tensor_parallel
from fxmegatron.passes.tensor_parallel.same_grads import average_redundant_grads
from fxmegatron.passes.tp_coverage import coverage
from fxmegatron.passes.trivial_collectives import drop_trivial_collectives

PLAN, COVERAGE = "fxmegatron/tp_plan", "fxmegatron/tp_coverage"   # keys in GraphModule.meta
# the passes name a collective's group by its mesh axis; materialisation binds it
TP_AXIS = "@tp"
CP_AXIS = "@cp"
DP_AXIS = "@dp"     # the ranks that sum gradients: dp, or dp × cp (``dp_shard="full"`` shards over them)
DP_REPLICATE_AXIS = "@dp_replicate"    # under hybrid sharding: the ranks that hold the same shards
EP_AXIS = "@ep"     # expert parallelism: the ranks that share their experts
EDP_AXIS = "@edp"   # ... and the ranks that hold the same experts (``dp_shard="full"`` shards the experts over them)
EXPERTS, EXPERT_CUT = "fxmegatron/experts", "fxmegatron/expert_cut"     # keys in GraphModule.meta
# data-parallel replicas see different samples: their dropout masks must differ too
DP_SEED_STRIDE = 0x9E3779B1


def tp_passes(cap: Captured, tp: int, tp_rank: int, group_name: str, sequence_parallel: bool,
              seed: int, dp_rank: int = 0, loss_grad: str = "kernel") -> List[Pass]:
    """The passes that make one tensor-parallel rank's graph from the captured one: placement
    planning and the rewrite with f/g and sequence collectives on ``group_name`` (the plan
    and its coverage land in ``gm.meta``), and counter-based dropout. ``loss_grad``: how the
    loss's backward may write over the logits (``passes.loss_grad_in_place``): "kernel" (the
    fused kernel, where proved), "graph" (as torch ops, inductor's call), "none"."""
    def tensor_parallel(gm):
        plan = plan_tensor_parallel(gm, tp, cap.params.keys(), sequence_parallel)
        apply_tensor_parallel(gm, plan, tp_rank, group_name)
        gm.meta[PLAN] = plan
        gm.meta[COVERAGE] = coverage(gm, plan, cap.params)   # before shapes become local
        return gm

    passes = [Pass("tensor_parallel", tensor_parallel, ensures={"tp_rewritten"})]
    passes.append(Pass("loss_reads_logits_dtype", loss_reads_logits_dtype, requires={"tp_rewritten"}))
    if loss_grad == "kernel":
        passes.append(Pass("loss_grad_reuses_logits", lambda gm: loss_grad_reuses_logits(gm, tp),
                           requires={"tp_rewritten"}))
    elif loss_grad == "graph":
        passes.append(Pass("loss_grad_in_graph", loss_grad_in_graph, requires={"tp_rewritten"}))
    passes.append(Pass("attention_rewrites", attention_rewrites, requires={"tp_rewritten"}))
    if tp == 1:
        passes.append(Pass("drop_trivial_collectives", drop_trivial_collectives, requires={"tp_rewritten"}))
    passes.append(Pass("counter_rng", lambda gm: apply_counter_rng(gm, tp_rank, tp, seed + DP_SEED_STRIDE * dp_rank),
                       requires={"tp_rewritten"}))
    return passes


def assemble_local(gm: fx.GraphModule, cap: Captured, plan: TPPlan, rank: int, world: int, device,
                   state_dict: Optional[Mapping] = None, seed: int = 0) -> fx.GraphModule:
    """The rank's GraphModule: its parameter shards, buffers and submodules, on ``device``."""
    local = materialize_graph(gm, cap, plan.param_plc, rank, world, device, state_dict, seed, source=gm,
                              experts=gm.meta.get(EXPERT_CUT))
    local.meta.update(gm.meta)
    return local


def check_local_shapes(gm: fx.GraphModule) -> fx.GraphModule:
    """Propagate fake tensors with the local shards: shapes of the rewritten graph must be
    consistent, and each node ends up with its local value in meta["val"]."""
    try:
        check_shapes(gm)
    except Exception as exc:
        at = [n for n in getattr(exc, "__notes__", ()) if n.startswith("at node ")]
        raise ShardingError(f"the tensor-parallel graph is inconsistent{' ' + at[0] if at else ''}: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return gm


def cp_passes(cap: Captured, cp: Axis, variant: str) -> List[Pass]:
    """Context parallelism, on the captured graph before tensor parallelism: attention's
    causal mask proved and dropped first (cp attention runs causal or full attention),
    then the graph cut to this rank's part of the sequence, and its shapes propagated."""
    if cp.size == 1:
        return []

    def cut(gm):
        # a mixture-of-experts block runs on the rank's tokens (found here where ep did not find it)
        blocks = gm.meta[EXPERTS] if EXPERTS in gm.meta else find_experts(gm)
        try:
            return apply_context_parallel(gm, cp.size, cp.rank, CP_AXIS, cap.params.keys(), variant, blocks)
        except ShardingError as exc:
            # the plan fails before the rewrite: the graph is still the captured one
            term = added_term(gm)
            if term is None or getattr(exc, "node", None) not in {n.name for n in ancestors(term)}:
                raise
            raise LossError(f"parallelize(cp={cp.size}) runs each rank on its chunks of the sequence, but "
                            f"{split_loss_problem(gm)}; context parallelism stopped inside that term ({exc}). To "
                            "proceed: turn the term off in the model (Hugging Face MoE models: "
                            "output_router_logits=False), or leave cp at 1") from exc

    return [Pass("attention_rewrites", attention_rewrites),
            Pass("context_parallel", cut),
            Pass("cp_local_shapes", check_local_shapes)]


def ep_passes(ep: Axis) -> List[Pass]:
    """Expert parallelism's two passes: the experts found on the captured graph, before any pass
    rewrites it (``find_experts``; their weights then cut to E/ep when the graph is localised),
    and the dispatch rewritten on the local graph, after tensor parallelism."""
    if ep.size == 1:
        return []

    def find(gm):
        blocks = find_experts(gm)
        if not blocks:
            raise ShardingError(f"parallelize(ep={ep.size}): the model has no mixture-of-experts block (no matmul over "
                                "a parameter with an experts dim, docs/EXPERT_PARALLEL.md): leave ep at 1")
        check_divisible(blocks, ep.size)
        check_supported(blocks)
        gm.meta[EXPERTS] = blocks
        gm.meta[EXPERT_CUT] = (expert_params(blocks), ep.rank, ep.size)
        return gm

    return [Pass("find_experts", find, ensures={"experts_found"})]


def ep_rewrite(ep: Axis) -> List[Pass]:
    if ep.size == 1:
        return []
    return [Pass("expert_parallel", lambda gm: apply_expert_parallel(gm, gm.meta[EXPERTS], ep.size, ep.rank, EP_AXIS),
                 requires={"experts_found", "tp_rewritten"})]


def expert_shards(gm: fx.GraphModule, params, edp: Axis):
    """The parameters ``dp_shard="full"`` shards, and those it shards over the expert-data-parallel
    group ("edp", ``EDP_AXIS``) rather than dp × cp: under expert parallelism an expert weight
    (``EXPERT_CUT``) holds E/ep experts, the same on the edp ranks alone, so it is sharded over them;
    where edp is one rank (dp = ep, no cp) there is nothing to shard it over and it stays whole
    (its gradient is averaged by the experts' ``GradSync``, ``runtime.model``)."""
    experts = gm.meta[EXPERT_CUT][0] if EXPERT_CUT in gm.meta else {}
    if edp.size == 1:
        return [n for n in params if n not in experts], {}
    return list(params), {n: (edp.size, EDP_AXIS) for n in experts}


def shard_world_of(axes: Mapping[str, Axis]) -> int:
    """The ranks a parameter's shards are spread over: dp × cp, or under hybrid sharding one
    replica group's dp ranks × cp (the "dp_cp" axis of ``mesh.mesh_axes``)."""
    if "dp_cp" in axes:
        return axes["dp_cp"].size
    return axes["dp"].size * axes.get("cp", Axis()).size


def schedules_collectives(cfg, axes: Mapping[str, Axis], device) -> bool:
    """Whether inductor's overlap scheduler orders this rank's collectives
    (``lower.torch_compile.inductor_options``): ``dp_shard="full"`` over several ranks, compiled, on
    GPUs, where its gathers are functional collectives it can move (``ops.dp_gather``)."""
    shard_world = shard_world_of(axes)
    return (cfg.dp_shard == "full" and shard_world > 1 and bool(cfg.compile) and device is not None
            and torch.device(device).type == "cuda")


def rank_passes(cap: Captured, axes: Mapping[str, Axis], cfg, device=None) -> List[Pass]:
    """Every graph pass of a rank, in order. After ``localize`` the graph holds meta shards.
    Collectives name the tp and cp axes (``TP_AXIS``, ``CP_AXIS``), not process groups: see
    ``groups``. ``device``: where the program runs (None: not known, as for planning; the
    passes that only pay off on one kind of device are left out)."""
    tp = axes["tp"]
    # a buffer written slice by slice stated as the cat it is, before any pass places values
    passes = [Pass("slice_writes_to_cat", slice_writes_to_cat)]
    if cfg.moe_capacity_factor is not None:
        # on the captured graph, before ep finds its blocks: the ep rewrite then gathers the masked weights
        passes.append(Pass("moe_capacity", lambda gm: apply_capacity(gm, cfg.moe_capacity_factor)))
    ep = axes.get("ep", Axis())
    passes += ep_passes(ep)
    passes += cp_passes(cap, axes.get("cp", Axis()), cfg.cp_attention)
    # where inductor's overlap scheduler pins its order in control_deps subgraphs, inductor (torch 2.11)
    # cannot lower a mutating custom op's auto_functionalized_v2 inside one: there the loss's backward
    # is stated as torch ops, which inductor may write over the logits itself
    wrapped = schedules_collectives(cfg, axes, device) and scheduler_wraps_nodes()
    passes += tp_passes(cap, tp.size, tp.rank, TP_AXIS, cfg.sequence_parallel, cfg.seed, axes["dp"].rank,
                        loss_grad="graph" if wrapped else "kernel")
    passes += [
        Pass("localize", lambda gm: assemble_local(gm, cap, gm.meta[PLAN], tp.rank, tp.size, "meta"),
             requires={"tp_rewritten"}),
        *ep_rewrite(ep),
        Pass("check_local_shapes", check_local_shapes, ensures={"local_shapes"}),
    ]
    if batch_term.applies(cfg):
        # a router's load-balancing loss from the whole batch's statistics, all-reduced over dp
        passes.append(Pass("batch_term", lambda gm: batch_term.over_dp(gm, axes["dp"].size, DP_AXIS),
                           requires={"local_shapes"}))
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
    if tp.size > 1:
        # after the passes that find a linear's weight as a graph input (ep's experts, FP8's casts),
        # before dp_shard, which gathers it for the block that reads it
        passes.append(Pass("same_grads", lambda gm: average_redundant_grads(gm, gm.meta[PLAN].param_plc, tp.size,
                                                                              TP_AXIS), requires={"local_shapes"}))
    shard_world = shard_world_of(axes)
    if cfg.dp_shard == "full" and shard_world > 1:
        # before recompute: a block's gather falls inside its recomputed region (see passes.dp_shard)
        policy = RecomputePolicy.of(cfg.recompute)
        again = bool(cfg.compile) and not (policy is not None and policy.blocks)
        # compiled: torch's functional collectives, which inductor can schedule (ops.dp_gather)
        replicas = DP_REPLICATE_AXIS if axes.get("dp_replicate", Axis()).size > 1 else ""

        def shard(gm):
            params, apart = expert_shards(gm, cap.params.keys(), axes.get("edp", Axis()))
            return shard_parameters(gm, params, shard_world, axes["dp"].size, DP_AXIS, again, per_use=cfg.pipelined(),
                                    functional=bool(cfg.compile), replicate_group=replicas, apart=apart)

        passes.append(Pass("dp_shard", shard, requires={"local_shapes"}))
    if cfg.compile:     # before recompute, which then finds one module's linears together
        passes.append(Pass("merge_linears", merge_linears, requires={"local_shapes"}))
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
        passes.append(Pass("tables_once", compute_tables_once, requires={"local_shapes"}))
    if device is not None and torch.device(device).type == "cuda":    # last: the other passes see SDPA
        passes.append(Pass("fused_attention_kernel", fused_attention_kernel, requires={"local_shapes"}))
    return passes


def groups(axes: Mapping[str, Axis]) -> dict:
    """The binding of the passes' axis names to this rank's process groups."""
    return {TP_AXIS: axes["tp"].group_name, CP_AXIS: axes.get("cp", Axis()).group_name,
            DP_AXIS: axes.get("dp_cp", axes["dp"]).group_name,
            DP_REPLICATE_AXIS: axes.get("dp_replicate", Axis()).group_name, EP_AXIS: axes.get("ep", Axis()).group_name,
            EDP_AXIS: axes.get("edp", Axis()).group_name}
