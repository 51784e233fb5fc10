"""What ``fxmegatron train --dry-run`` prints: a layout's parameters and memory per rank and its
schedule, from the model on the meta device, without a process group or a weight allocated.

    plan = plan_run(model_on_meta, global_batch, dp=1, pp=4, tp=2, sequence_parallel=True,
                    recompute="none", virtual_stages=1, microbatches=8, schedule="1f1b",
                    param_dtype=torch.bfloat16, optimizer="adamw")
    print(plan.format())

    python -m fxmegatron.train.plan --llama8b --pp 4 --tp 2 --microbatches 8 --seq 8192

One capture; then the compiler's passes and pipeline cut (``lower.rank.build_rank``, as ``parallelize``
and ``verify`` run them) for tp rank 0 only, leaving meta shards: tp ranks hold shards of equal
shapes and run the same graph, so rank 0 speaks for all. The cut (``split_pipeline``) of that one
graph gives every pipeline rank's chunks (chunk c on rank c mod pp), so no rank is built twice;
activations are measured on them (``plan_memory``); nothing is materialised."""
from __future__ import annotations

import argparse
import copy
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from fxmegatron.capture import capture
from fxmegatron.compiler import first_microbatch
from fxmegatron.layout import RECOMPUTE_MODES, SCHEDULE_NAMES, Layout
from fxmegatron.lower.rank import build_rank
from fxmegatron.lower.rank_passes import EXPERT_CUT
from fxmegatron.placement import R, Shard, local_shape, shard_slices
from fxmegatron.schedules import Schedule, simulate
from fxmegatron.train.plan_memory import (OPTIMIZERS, grad_bytes, in_flight,
                                          optimizer_bytes, saved_by_chunks, timeline_text)

# the layout's fields the plan reads; the others (fuse, compile, fp8, tp_comm_overlap) change
# kernels and communication, not what a rank holds or saves, and are left out of the plan
PLANNED = ("dp", "pp", "cp", "tp", "sequence_parallel", "recompute", "microbatches", "virtual_stages", "schedule",
           "blocks_per_chunk", "grad_accum_dtype", "cp_attention", "ep")

@dataclass
class StagePlan:
    """One pipeline rank, as each of its tensor-parallel ranks sees it."""

    pp_rank: int
    chunks: Tuple[int, ...]
    blocks: Tuple[str, ...]            # per chunk: the units it runs
    params: int                        # elements held by each tp rank
    split: int                         # of which shards of parameters split over tp
    replicated: int                    # of which whole parameters, the same on every tp rank
    stage_params: int                  # distinct elements over the stage's tp ranks: split·tp + replicated
    tied: Tuple[str, ...]              # parameters other pipeline ranks hold too
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved: Dict[int, int]              # chunk -> bytes kept per microbatch until its backward
    in_flight: Dict[int, int]          # chunk -> most microbatches in flight
    activation_bytes: int
    recompute_bytes: int = 0           # the largest recomputed region, while its backward runs it
    local: Dict[str, int] = field(default_factory=dict)   # parameter -> its elements on each tp rank
    # expert parallelism: of the above, the rank's E/ep experts (its tp shards of them), their
    # distinct elements over the stage's tp ranks, and their gradient and optimizer bytes
    experts: int = 0
    expert_stage: int = 0
    expert_grad_bytes: int = 0
    expert_optimizer_bytes: int = 0

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self.local)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes + \
            self.recompute_bytes


@dataclass
class RunPlan:
    model: str
    model_params: int                  # every parameter once (tied ones once)
    dp: int
    pp: int
    tp: int
    virtual_stages: int
    microbatches: int
    schedule: str                      # "" without a pipeline
    sequence_parallel: bool
    recompute: str
    param_dtype: torch.dtype
    optimizer: str
    grad_accum_dtype: Optional[torch.dtype]
    microbatch: List[str]              # each batch input at microbatch size
    stages: List[StagePlan]
    tied: Dict[str, Tuple[int, ...]]   # parameter -> the pipeline ranks holding a copy (two or more)
    aliases: Dict[str, str]            # a tied name in the model -> the name it is counted under
    unused: List[str]                  # parameters no chunk uses (held by no rank)
    unused_numel: int
    tied_numel: Dict[str, int]         # whole elements of each tied parameter
    bubble: Optional[float]
    timeline: str
    coverage: str
    seconds: float
    notes: List[str] = field(default_factory=list)
    cp: int = 1                        # context parallelism: activations are cp rank 0's two chunks
    dp_shard: str = "none"             # what the dp·cp ranks shard (counted per rank)
    shard_ranks: int = 1               # the ranks sharing each piece (dp·cp, or / dp_replicate)
    ep: int = 1                        # expert parallelism: each rank holds E/ep experts of every block

    @property
    def tied_copies(self) -> int:
        """Elements held more than once across pipeline ranks (a copy per extra holder)."""
        return sum(self.tied_numel[n] * (len(r) - 1) for n, r in self.tied.items())

    def format(self) -> str:
        from fxmegatron.train.plan_text import plan_lines
        return "\n".join(plan_lines(self))


def plan_run(model_on_meta: nn.Module, example_global_batch, dp: int = 1, pp: int = 1, tp: int = 1,
             sequence_parallel: bool = False, recompute="none", virtual_stages: int = 1, microbatches: int = 1,
             schedule: Optional[str] = None, param_dtype: Optional[torch.dtype] = None, optimizer: str = "adamw",
             grad_accum_dtype: Optional[torch.dtype] = None, blocks_per_chunk: Optional[Sequence[int]] = None,
             device: str = "cuda", picture: Optional[str] = None, cp: int = 1,
             cp_attention: str = "ring", layout: Optional[Layout] = None, dp_shard: str = "none",
             ep: int = 1) -> RunPlan:
    """The plan of a run (module docstring). ``example_global_batch``: one optimizer step's
    batch over all data-parallel ranks (split over dp, then into ``microbatches``, as
    ``parallelize`` splits it). ``param_dtype``: the dtype the parameters train in (the
    model is cast on a copy; None: as it is). ``device``: where the run will be, "cuda" or
    "cpu", which decides the form of the ops whose kernels keep other tensors than their torch
    form (``plan_memory``). ``picture``: also draw the schedule to this .png or .svg. ``cp``:
    context parallelism, the graph of cp rank 0 (its two chunks of the sequence; every cp rank
    holds as much), with ``cp_attention``. ``layout``: a ``Layout`` in place of the layout's
    keywords (dp, pp, tp, cp and the options). ``dp_shard`` (or the layout's, over dp·cp /
    dp_replicate ranks): "optimizer" (its state), "gradients" (gradients too) or "full" (parameters
    too; the transient gathered block left out, as the caveat says of gathers). ``ep``: expert
    parallelism folded onto dp (each rank E/ep experts of every block; under ``dp_shard`` their
    pieces over dp·cp / ep ranks)."""
    t0 = time.perf_counter()
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: expected 'cuda' or 'cpu'")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {OPTIMIZERS}")
    model = _in_dtype(model_on_meta, param_dtype)
    if layout is not None:
        cfg = Layout(**{n: getattr(layout, n) for n in PLANNED})
    else:
        cfg = Layout(dp=dp, pp=pp, tp=tp, cp=cp, sequence_parallel=sequence_parallel, recompute=recompute,
                     microbatches=microbatches, virtual_stages=virtual_stages, schedule=schedule,
                     blocks_per_chunk=blocks_per_chunk, grad_accum_dtype=grad_accum_dtype, cp_attention=cp_attention,
                     ep=ep)
    dp, pp, tp, cp, microbatches = cfg.dp, cfg.pp, cfg.tp, cfg.cp, cfg.microbatches
    grad_accum_dtype = cfg.grad_accum_dtype
    sched = cfg.make_schedule()        # the layout's errors before the capture's seconds
    cap = capture(model, first_microbatch(example_global_batch, microbatches, dp))
    # the compiler's passes for tp rank 0 (cp rank 0: its two chunks of the sequence, every cp
    # rank's alike in size) on the capture itself (nothing else reads it), and the pipeline cut;
    # no materialisation and no boundary propagation: the activations' run on meta finds the boundaries
    built = build_rank(cap, cfg, {}, None, {})
    local, tp_plan = built.local, built.plan
    experts = local.meta.get(EXPERT_CUT, ({},))[0]     # expert parameters (ep > 1): cut to E/ep on each rank
    example = [n.meta["val"] for n in local.graph.nodes if n.op == "placeholder"]
    if built.chunks is not None:
        chunks = built.chunks
        modules = [c.gm for c in chunks]
        uses = {c.index: [n for n in c.params if n in cap.params] for c in chunks}
        grads, inputs = [c.boundary_grad for c in chunks], [c.batch_inputs for c in chunks]
        blocks = {c.index: _units_label(c.units) for c in chunks}
    else:
        modules, grads, inputs = [local], [[]], [list(range(len(example)))]
        uses = {0: sorted({n.target for n in local.graph.nodes if n.op == "get_attr" and n.target in cap.params})}
        blocks = {0: "the whole model"}
    micro = [torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
             for v in example]
    # where fxmegatron's kernels run (codegen.where_kernels_run): GPUs, the CPU under the interpreter
    kernels = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    kept, transient = saved_by_chunks(modules, grads, inputs, micro, kernels)
    saved, regions = dict(enumerate(kept)), dict(enumerate(transient))
    holders: Dict[str, set] = {}
    for c, names in uses.items():
        for n in names:
            holders.setdefault(n, set()).add(c % pp)
    placements = dict(tp_plan.param_plc)
    stages = [_stage(r, sorted(c for c in saved if c % pp == r), uses, holders, blocks, saved, sched, cap.params,
                     placements, tp, optimizer, grad_accum_dtype is not None, microbatches, experts, cfg.ep)
              for r in range(pp)]
    for st in stages:
        st.recompute_bytes = max(regions[c] for c in st.chunks)
    dp_shard = layout.dp_shard if layout is not None else dp_shard
    shards = dp * cp // (layout.dp_replicate if layout is not None else 1) if dp_shard != "none" else 1
    # the experts' pieces over the ranks holding the same experts (dp·cp / ep)
    expert_shards = max(shards // cfg.ep, 1)

    def share(total: int, expert: int) -> int:
        return -(-(total - expert) // shards) - (-expert // expert_shards)

    for st in stages:       # each rank's share (the padding of each piece left out)
        st.optimizer_bytes = share(st.optimizer_bytes, st.expert_optimizer_bytes)
        if dp_shard in ("gradients", "full"):
            st.grad_bytes = share(st.grad_bytes, st.expert_grad_bytes)
        if dp_shard == "full":
            st.param_bytes = -(-st.param_bytes // shards)
    tied = {n: tuple(sorted(r)) for n, r in holders.items() if len(r) > 1}
    notes = [f"parameter {n} is split unevenly over tp={tp}: tp rank 0 does not speak for the others"
             for n, plc in placements.items() if isinstance(plc, Shard) and not _even(cap.params[n].shape, plc, tp)]
    res = simulate(sched, 1.0, 2.0) if sched is not None else None
    if picture and sched is not None:
        from fxmegatron.schedules.draw import draw_timeline
        draw_timeline(sched, picture)
        notes.append(f"schedule drawn to {picture}")
    return RunPlan(
        model=cap.model_cls, model_params=sum(t.numel() for t in cap.params.values()), dp=dp, pp=pp, tp=tp,
        virtual_stages=cfg.virtual_stages, microbatches=microbatches, schedule=sched.name if sched else "",
        sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute_name,
        param_dtype=next(iter(cap.params.values())).dtype if cap.params else torch.float32, optimizer=optimizer,
        grad_accum_dtype=grad_accum_dtype,
        microbatch=[f"{name} {list(v.shape)} {str(v.dtype).replace('torch.', '')}" for name, v in
                    zip(cap.input_names, example) if isinstance(v, torch.Tensor)],
        stages=stages, tied=tied, aliases=dict(cap.aliases),
        unused=sorted(n for n in cap.params if n not in holders),
        unused_numel=sum(t.numel() for n, t in cap.params.items() if n not in holders),
        tied_numel={n: cap.params[n].numel() for n in tied},
        bubble=res.overall_bubble_fraction if res else None, timeline=timeline_text(sched, res) if res else "",
        coverage=built.coverage.summary() if tp > 1 else "",
        seconds=time.perf_counter() - t0, notes=notes + list(cap.notes), cp=cp, dp_shard=dp_shard, shard_ranks=shards,
        ep=cfg.ep)


def _in_dtype(model: nn.Module, dtype: Optional[torch.dtype]) -> nn.Module:
    """The model with floating parameters and buffers in ``dtype``: a copy, the caller's is left."""
    if dtype is None or all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return model
    return copy.deepcopy(model).to(dtype)


def _numel(shape, plc, tp: int) -> int:
    return math.prod(local_shape(shape, plc, tp))


def _even(shape, plc: Shard, tp: int) -> bool:
    size = shape[plc.dim]
    return sum(n for r in range(tp) for _, n in shard_slices(size, plc, r, tp)) == size


def _stage(r: int, chunks: List[int], uses, holders, blocks, saved, sched: Optional[Schedule], params,
           placements, tp: int, optimizer: str, grad_accum: bool, microbatches: int, experts=(), ep: int = 1
           ) -> StagePlan:
    used = [n for c in chunks for n in uses[c]]
    names = sorted(set(used))
    # as the runtime: fp32 sums where a gradient accumulates more than once a step (several
    # microbatches, or a weight two chunks of the rank use)
    fp32_sums = grad_accum and (microbatches > 1 or len(used) > len(names))
    split = replicated = nbytes = expert = expert_stage = 0
    trainable: List[Tuple[int, torch.dtype]] = []
    trainable_experts: List[Tuple[int, torch.dtype]] = []
    local = {}
    for n in names:
        t, plc = params[n], placements.get(n, R)
        # an expert weight: its tp shard, cut to this rank's E/ep experts (ep divides E: checked)
        k = local[n] = _numel(t.shape, plc, tp) // (ep if n in experts else 1)
        if isinstance(plc, Shard):
            split += k
        else:
            replicated += k
        nbytes += k * t.element_size()
        if n in experts:
            expert += k
            expert_stage += k * tp if isinstance(plc, Shard) else k
        if t.requires_grad:
            trainable.append((k, t.dtype))
            if n in experts:
                trainable_experts.append((k, t.dtype))
    mine = {c: saved[c] for c in chunks}
    act, peak = in_flight(sched, r, mine)
    return StagePlan(r, tuple(chunks), tuple(blocks[c] for c in chunks), split + replicated, split, replicated,
                     split * tp + replicated, tuple(n for n in names if len(holders[n]) > 1), nbytes,
                     grad_bytes(trainable, fp32_sums), optimizer_bytes(trainable, optimizer), mine, peak, act,
                     local=local, experts=expert, expert_stage=expert_stage,
                     expert_grad_bytes=grad_bytes(trainable_experts, fp32_sums),
                     expert_optimizer_bytes=optimizer_bytes(trainable_experts, optimizer))


def _units_label(units: Sequence[str]) -> str:
    """"embedding, model.layers.0-7" for a chunk's units."""
    # paths are the capture wrapper's ("model." + the model's own)
    blocks = [u.removeprefix("model.") for u in units if u not in ("pre", "post")]
    parts = ["embedding"] if "pre" in units else []
    if blocks:
        head, _, first = blocks[0].rpartition(".")
        last = blocks[-1].rpartition(".")[2]
        parts.append(f"{head}.{first}" + (f"-{last}" if len(blocks) > 1 else ""))
    if "post" in units:
        parts.append("head+loss")
    return ", ".join(parts)


def llama8b(layers: int = 32, seq: int = 8192) -> nn.Module:
    """A Llama-3-8B-shaped ``LlamaForCausalLM`` on the meta device (bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=seq, use_cache=False,
                      rope_theta=500000.0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).train()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fxmegatron.train.plan", description="Dry-run plan of a layout.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--llama8b", action="store_true", help="a Llama-3-8B-shaped HF model")
    src.add_argument("--hf-config-json", help="an HF config.json; the causal LM it describes, on meta")
    for name, default in (("dp", 1), ("pp", 1), ("cp", 1), ("tp", 1), ("ep", 1), ("virtual-stages", 1),
                          ("microbatches", 1), ("seq", 8192), ("micro-batch-size", 1)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--schedule", choices=SCHEDULE_NAMES)
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    for flag in ("--grad-accum-fp32", "--sequence-parallel"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--picture", help="also draw the schedule to this .png/.svg")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    if a.llama8b:
        model = llama8b(seq=a.seq)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(a.hf_config_json)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        model.train()
    ids = torch.zeros(a.micro_batch_size * a.microbatches * a.dp, a.seq, dtype=torch.long, device="meta")
    plan = plan_run(model, {"input_ids": ids, "labels": ids}, dp=a.dp, pp=a.pp, tp=a.tp, cp=a.cp,
                    sequence_parallel=a.sequence_parallel, recompute=a.recompute, virtual_stages=a.virtual_stages,
                    microbatches=a.microbatches, schedule=a.schedule, param_dtype=getattr(torch, a.dtype),
                    optimizer=a.optimizer, grad_accum_dtype=torch.float32 if a.grad_accum_fp32 else None, ep=a.ep,
                    picture=a.picture)
    print(plan.format())
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
