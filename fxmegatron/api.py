"""``parallelize``: the public entry point. It checks the options (a ``Layout``),
reads the mesh, asks the compiler for this rank's program and returns the
``ParallelModel`` that runs it."""
from __future__ import annotations

import copy
import warnings
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.compiler import compile_program
from fxmegatron.layout import Layout
from fxmegatron.mesh import mesh_axes, runtime_device
from fxmegatron.ops.fp8 import check_fp8_device
from fxmegatron.runtime.model import ParallelModel
from fxmegatron.verify import verify as check_layout

__all__ = ["parallelize", "ParallelModel"]


def parallelize(model: nn.Module, mesh, example_batch, *, sequence_parallel: bool = False,
                recompute="none", microbatches: int = 1, virtual_stages: int = 1,
                schedule: Optional[str] = None, blocks_per_chunk: Optional[Sequence[int]] = None,
                fuse: bool = False, compile=False, tp_comm_overlap: int = 0, tp_comm_transport: str = "auto",
                state_dict: Optional[Mapping] = None, seed: int = 0, verbose: bool = False,
                grad_accum_dtype: Optional[torch.dtype] = None, verify: bool = False, min_split: float = 0.5,
                cp_attention: str = "ring", precision: str = "bf16", fp8_recipe: str = "tensorwise",
                fp8_policy="all", dp_shard: str = "none", dp_replicate: int = 1, ep: int = 1,
                moe_capacity_factor: Optional[float] = None, _chunked: bool = False) -> ParallelModel:
    """Trace ``model`` on ``example_batch`` and return this rank's parallel piece.

    ``mesh``: a torch DeviceMesh with dims named from "dp", "pp", "cp", "tp" (or None: one
    process). "cp" (context parallelism) splits the whole model's sequence: rank r of cp
    holds chunks r and 2·cp−1−r of 2·cp, and attention exchanges keys and values
    (``cp_attention``: "ring", P2P around the cp ranks while computing, or "allgather").
    ``example_batch``: what ``model`` is called with (tuple -> positional, dict ->
    keyword); its forward must return the loss. ``sequence_parallel``: norms, dropout
    and residual adds run on sequence shards between tensor-parallel regions (g becomes
    a reduce-scatter, f an all-gather). ``recompute``: "none", "selective" (attention
    core), "full" (each transformer block) or a ``RecomputePolicy``.
    Pipeline: the graph is cut into pp·``virtual_stages`` chunks at transformer blocks
    (balanced by cost, or ``blocks_per_chunk``), chunk c on pp rank c % pp, run by
    ``schedule`` ("gpipe", "1f1b", "interleaved"; default 1f1b, or interleaved when
    virtual_stages > 1) over ``microbatches`` per ``train_step``. A step that splits the batch
    (microbatches > 1 or a "dp" dim) weights each piece's mean cross-entropy by the labels it
    counts, which is exact; a loss that is not that cross-entropy alone (up to views, casts and
    constant scaling), such as one with an MoE router's load-balancing loss added, is refused
    with a ``LossError`` naming the node (``passes.loss_terms``).
    ``fuse``: each run of elementwise ops becomes one generated Triton kernel (forward, and a
    backward that recomputes the run); without CUDA the runs execute as the original ops.
    With ``compile`` too, each run is one opaque call in the compiled graph that launches
    those kernels, and inductor generates the kernels of everything else.
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
    (True, or a torch.compile mode string); inductor then generates the kernels (but the
    fused runs', with ``fuse=True``).
    Weights come from ``state_dict``, else from the model, else (meta model) are
    initialised shard by shard. ``seed``: for that initialisation and
    for dropout masks (counter-based, keyed by element index: see ``fxmegatron.ops.dropout``).
    ``grad_accum_dtype``: torch.float32 sums the gradients of bf16/fp16 parameters over a
    step's microbatches (and pipeline chunks) in fp32, rounding once at the end (Megatron's
    main_grad; ``fxmegatron.runtime.grad_accumulation``); None (default) lets autograd accumulate in
    the parameters' dtype.
    ``verify``: before transforming, check the layout (tp, sequence parallelism, recompute,
    pp, dp, cp) against the model in eager on simulated ranks in this process
    (``fxmegatron.verify``; needs the model's real weights, so use it with a tiny config).
    ``precision``: "bf16" (default: the model's own dtypes) or "fp8": the matmuls of linear
    layers, forward and both backward GEMMs, in FP8 with dynamic scales (``fp8_recipe``
    "tensorwise" or "rowwise", as torchao's recipes); ``fp8_policy`` "all", "attention",
    "mlp", a list of module-path regexes or an ``FP8Policy``. The LM head, embeddings, norms
    and the loss stay; weights keep their masters; on CUDA it needs sm_89+, elsewhere the
    GEMMs are emulated (rounded to FP8, multiplied in fp32); plan.txt says per linear what it
    runs in and why. The FP8 program does not depend on tp (amaxes are max-reduced over tp).
    ``dp_shard``: "none" (every data-parallel rank, and every cp rank, keeps the whole optimizer
    state of its parameters) or "optimizer" (ZeRO-1, Megatron's distributed optimizer: each
    bucket of gradients is reduce-scattered over those ranks as soon as backward has finished
    it, each rank keeps fp32 masters, m and v for its share, and its optimizer step
    all-gathers the updated parameters; build the optimizer with ``pm.adamw(...)``; see
    ``fxmegatron.runtime.sharded_dp``) or "gradients" (ZeRO-2: the same, and a bucket is
    reduce-scattered after every microbatch, its pieces summed, so no whole gradient outlives
    its bucket) or "full" (ZeRO-3: every parameter a flat shard per rank,
    each block's gathered by one graph node before it and again for the backward, gradients
    reduce-scattered by autograd; ``passes.dp_shard``; in pipeline stages too).
    ``dp_replicate``: hybrid sharding (HSDP): the mesh's dp ranks split into this many groups
    (dp-major: ranks 0..dp/R-1 of the dp dim are the first group); each shards over its own ranks
    (× cp) as ``dp_shard`` says, and the groups are replicas of each other, their reduced shards
    summed over the ``dp_replicate`` ranks that hold the same shard.
    ``ep``: expert parallelism, folded onto the data-parallel ranks: each ``ep`` consecutive dp
    ranks hold E/ep whole experts of every mixture-of-experts block (found from the graph's ops,
    ``passes.expert_parallel``) and compute them for the tokens of all ``ep`` (the all-gather
    dispatcher); expert gradients are summed over the dp / ep ranks that hold the same experts.
    ``moe_capacity_factor``: None (dropless: the model's own semantics) or cf > 0: on each rank's
    own tokens of a block's forward, expert e keeps at most ceil(cf · T · k / E) of its (token,
    slot) assignments, those of the largest routing weights (ties: the earlier token); a dropped
    one's combine weight is 0 (Megatron's "probs" drop policy, without padding). The same at any
    ep (docs/EXPERT_PARALLEL.md); not with tp, cp, pp or verify yet.
    ``min_split``: at tp > 1, warn (naming the modules) when less than this share of the
    matmul FLOPs is split; ``pm.coverage`` and the dump's plan.txt always say how much is.
    """
    # the options are checked before the mesh is read, the schedule before verify and capture
    cfg = Layout(sequence_parallel=sequence_parallel, recompute=recompute, microbatches=microbatches,
                 virtual_stages=virtual_stages, schedule=schedule, blocks_per_chunk=blocks_per_chunk,
                 fuse=fuse, compile=compile, tp_comm_overlap=tp_comm_overlap,
                 tp_comm_transport=tp_comm_transport, state_dict=state_dict, seed=seed, verbose=verbose,
                 grad_accum_dtype=grad_accum_dtype, verify=verify, min_split=min_split, chunked=_chunked,
                 cp_attention=cp_attention, precision=precision, fp8_recipe=fp8_recipe, fp8_policy=fp8_policy,
                 dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep,
                 moe_capacity_factor=moe_capacity_factor)
    axes = mesh_axes(mesh, cfg.dp_replicate, cfg.ep)
    cfg = cfg.with_degrees(axes)
    cfg.make_schedule()
    device = runtime_device(mesh, model)
    if cfg.precision == "fp8":
        check_fp8_device(device)
    if cfg.verify:
        _verify_first(model, example_batch, axes, cfg)
    program = compile_program(model, example_batch, axes, device, cfg)
    if cfg.verbose and _rank0():
        print("fxmegatron: " + ", ".join(f"{k} {v:.2f}" for k, v in program.timings.items()), flush=True)
    _warn_coverage(program.coverage, cfg.min_split)
    return ParallelModel(program, cfg.grad_accum_dtype, cfg.dp_shard)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _verify_first(model, example_batch, axes, cfg: Layout) -> None:
    # simulated ranks run on the CPU (verify refuses a meta model itself)
    on_cpu = all(p.device.type in ("cpu", "meta") for p in model.parameters())
    cpu = model if on_cpu else copy.deepcopy(model).cpu()
    report = check_layout(cpu, pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), example_batch), layout=cfg)
    if _rank0():
        print(f"fxmegatron: {report}", flush=True)


def _warn_coverage(cov, min_split: float) -> None:
    if cov.tp > 1 and cov.flops_split < min_split and _rank0():
        warnings.warn(f"fxmegatron: only {cov.flops_split:.0%} of the matmul FLOPs are split over tp={cov.tp} "
                      f"(min_split={min_split:.0%}): the largest replicated ones are\n"
                      + "\n".join(f"  {w} ({f:.1%}): {why}" for w, f, why in cov.replicated[:5]), stacklevel=3)
