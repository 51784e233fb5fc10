"""End to end: the bundled GPT trained by several frameworks side by side, one table.

Every layout trains the same GPT (examples/gpt.py: learned positions, LayerNorm,
tanh-GeLU, untied embeddings, bias, dropout 0) on the same synthetic batch with the
same optimizer, one layout after the other in one process group:

    python benchmarks/end_to_end.py --model gpt1.3b --layouts eager,compile,fx,fx-fuse        # one GPU
    torchrun --nproc-per-node 4 benchmarks/end_to_end.py --model gpt6.7b \\
        --layouts native-tp4,fx-tp4,fx-tp2-pp2-v2,fx-pp4-1f1b,fx-pp4-v2,fx-dp2-tp2
    # CPU smoke runs (gloo), with the loss check against the plain model:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/end_to_end.py --tiny --device cpu \\
        --dtype float32 --check --steps 2 --warmup 1 \\
        --layouts native-tp4,fx-tp4,fx-tp2-pp2-v2,fx-pp4-1f1b,fx-pp4-v2,fx-dp2-tp2
    python benchmarks/end_to_end.py --tiny --device cpu --dtype float32 --check --layouts eager,compile,fx \\
        --steps 2 --warmup 1

Models (--model; --layers/--hidden/--heads/--seq/--vocab/--global-batch override):
gpt1.3b (24 layers, h 2048, 16 heads, s 2048, V 50304, global batch 8), gpt6.7b
(32, 4096, 32, 2048, 50304, batch 16), gpt13b (40, 5120, 40, 2048, 50304, batch 32);
--tiny: 8 layers, h 64, 4 heads, s 64, V 512, batch 16 (8 layers: fx-pp4-v2 cuts the
model into 8 chunks of at least one block each; batch 16: with 8, pipeline microbatches
hold one sequence, and fxmegatron's gloo-only reduce-scatter then returns a view of its
input, which torch.library refuses).

Layouts (--layouts, a comma list; the product of the parallel sizes must equal the
number of processes):
- ``eager``: the plain model. ``compile``: ``torch.compile(model)`` (``compile-autotune``: mode
  "max-autotune-no-cudagraphs", ``compile-cgraphs``: "reduce-overhead"). One process only.
- ``native-tpN``: PyTorch's own tensor parallelism on DTensor
  (``parallelize_module``), torchtitan's Llama plan: wte RowwiseParallel (output
  Shard(1)), LayerNorms SequenceParallel, attention/MLP inputs PrepareModuleInput
  Shard(1) -> Replicate, q/k/v/fc ColwiseParallel, attn.proj/mlp.proj RowwiseParallel
  (output Shard(1)), lm_head ColwiseParallel (input Shard(1), output Shard(-1)) with the
  loss under ``loss_parallel()`` (vocab-parallel cross-entropy: the full logits are never
  gathered, as fxmegatron does); the position embedding wpe stays replicated and its
  output is cut to the rank's sequence shard (Megatron's way); each Block is wrapped in
  ``torch.compile``. Attention runs on the local heads (a forward that views
  ``(B, T, -1, head_dim)``: the same math).
- ``fx[-tpN][-ppN][-dpN][-vN][-mN][-1f1b|-gpipe|-interleaved][-fuse|-compile|-cgraphs|-autotune][-nosp][-rsel|-rfull][-fadam][-acc32][-ovN][-nccl|-ce]``:
  ``fxmegatron.parallelize`` on a ("dp", "pp", "tp") device mesh, the model built on the
  meta device. tp > 1 turns sequence parallelism on (``-nosp``: off); ``-vN`` virtual
  stages (interleaved 1F1B); ``-mN`` microbatches (default: --microbatches, 8, when pp > 1,
  else 1); ``-fuse``: generated Triton kernels; ``-compile``: each rank's graph (or
  pipeline chunk) through torch.compile (``-cgraphs``: its mode "reduce-overhead", CUDA graphs;
  ``-autotune``: "max-autotune-no-cudagraphs"); ``-rsel``/``-rfull``: recomputation; ``-fadam``:
  fxmegatron's optimizer (``fxmegatron.optim.FusedAdamW``: the same AdamW on fp32 masters in
  one pass, the clip's scale folded in) instead of the shared one; ``-acc32``: gradients summed
  over microbatches in fp32 (``grad_accum_dtype=torch.float32``); ``-ovN``: sequence
  parallelism's collectives overlapped with their matmuls, the batch cut in N pieces
  (``tp_comm_overlap=N``; over copy engines, the tp ranks' sequence slices, whatever N),
  moved by the copy engines where the group has symmetric memory
  (``-ce``: insist on it) or by NCCL (``-nccl``): ``tp_comm_transport``.
- ``-mN`` on eager/compile/native-tpN: gradient accumulation over N microbatches.

A step = forward + backward (``pm.train_step(ids, labels)`` for fxmegatron), clipping
to norm 1.0 (``torch.nn.utils.clip_grad_norm_``, which takes DTensor gradients, or
``pm.clip_grad_norm_``), and AdamW (lr 1e-4, fused on CUDA) on fp32 master copies of the
model's parameters (bf16 by default): Megatron's mixed precision, the same class
(``MasterWeightAdamW``) for every layout but ``-fadam`` ones (the same update, fused).

Measured per layout: --warmup steps, then --steps timed steps (synchronised, a barrier
before each; a step's time is the slowest rank's), median step time; tokens/s =
B·s / step time with B the global batch; model FLOPs per step (Korthikanti et al. 2022,
activation recomputation not counted)

    F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))

TFLOP/s per GPU = F / step time / world size; MFU against a bf16 8192×8192×8192 matmul
timed at the start of the run (--peak-tflops overrides); peak memory (max over ranks of
torch.cuda.max_memory_allocated, reset after the layout's model is built, so the
fp32-then-cast build of eager/native models is not counted); loss of the first and
last step. Then one more step under torch.profiler on rank 0, whose GPU kernels give:
compute (union of the non-communication kernels), exposed communication (a collective
NCCL kernel running and no compute kernel), pipeline bubble (an NCCL send/recv kernel
running and no compute kernel) and idle (the step's wall time minus the union of all
kernels), printed in ms and in % of the profiled step's wall time (which the profiler
makes somewhat longer than the median step). CPU runs profile too (--profile-dir writes
their traces) but have no kernels, so the breakdown is left empty.

``--check`` (float32) trains the plain model for the first two steps and compares every
layout's first two losses and first gradient norm (before clipping) with it; more than
1e-4 relative anywhere, or a layout that fails, exits non-zero. fxmegatron layouts then
get the plain model's weights (``state_dict=``); otherwise they initialise their own
shards (N(0, 0.02)), so their first loss differs slightly from eager's.

A layout that fails (an OOM, say) gives an "error" row and the run goes on: ranks agree
through an all-reduce of a failure flag after each layout. A rank that fails in the
middle of a collective, or a layout that deadlocks, still leaves the others waiting until
the backend's timeout; ``--hang-dump SECONDS`` prints every rank's Python stacks when a
layout runs longer than that.

Problems this benchmark found in fxmegatron on 4 H200s, fixed since: ``fx-dp2-*`` failed
at once (the dp all-reduce of the token counts was a CPU tensor), and ``fx-tp2-pp2-v2``
hung in its first step (every boundary relayed sequence parallelism's per-parameter
copies: 39 tensors per microbatch instead of 1).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import gc
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpt import GPT, GPTConfig  # noqa: E402

import fxmegatron  # noqa: E402

MODELS = {  # layers, hidden, heads, seq, vocab, global batch
    "gpt1.3b": (24, 2048, 16, 2048, 50304, 8),
    "gpt6.7b": (32, 4096, 32, 2048, 50304, 16),
    "gpt13b": (40, 5120, 40, 2048, 50304, 32),
    # tiny: 8 layers so that fx-pp4-v2 has a block per chunk; batch 16 so that pipeline microbatches hold
    # 2 sequences: with 1, fxmegatron's gloo reduce-scatter returns a view of its input and fails
    "tiny": (8, 64, 4, 64, 512, 16),
}
CHECK_RTOL = 1e-4
STEP_MARK = "end_to_end_step"     # the profiler annotation around the profiled step


def model_flops(b, s, l, h, v):
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


# ---- layouts ------------------------------------------------------------------------------
@dataclass
class Layout:
    name: str
    kind: str                   # eager, compile, native, fx
    dp: int = 1
    pp: int = 1
    tp: int = 1
    v: int = 1
    m: int = 1
    schedule: Optional[str] = None
    sp: bool = True
    fuse: bool = False
    compile: object = False     # False, True or a torch.compile mode
    recompute: str = "none"
    fadam: bool = False
    fp32_accum: bool = False    # parallelize(grad_accum_dtype=torch.float32)
    overlap: int = 0
    transport: str = "auto"

    @property
    def world(self):
        return self.dp * self.pp * self.tp


def parse_layout(name: str, pp_microbatches: int) -> Layout:
    """``eager``, ``compile``, ``native-tpN``, ``fx-...`` (see the module docstring), each
    with an optional ``-mN``. Raises ValueError with the reason."""
    head, *tokens = name.split("-")
    if head not in ("eager", "compile", "native", "fx"):
        raise ValueError(f"layout {name!r}: starts with {head!r}; expected eager, compile, native-tpN or fx[-...]")
    lay = Layout(name, head)
    m = None
    for tok in tokens:
        num = re.fullmatch(r"(tp|pp|dp|v|m|ov)(\d+)", tok)
        if num and (head == "fx" or num.group(1) in ("tp", "m") and (head == "native" or num.group(1) == "m")):
            key, val = num.group(1), int(num.group(2))
            if val < 1:
                raise ValueError(f"layout {name!r}: {tok} must be >= 1")
            if key == "m":
                m = val
            elif key == "ov":
                lay.overlap = val
            else:
                setattr(lay, key, val)
        elif head == "fx" and tok in ("1f1b", "gpipe", "interleaved"):
            lay.schedule = tok
        elif head == "fx" and tok == "fuse":
            lay.fuse = True
        elif head == "fx" and tok == "compile":
            lay.compile = lay.compile or True
        elif head in ("fx", "compile") and tok in ("cgraphs", "autotune"):
            lay.compile = {"cgraphs": "reduce-overhead", "autotune": "max-autotune-no-cudagraphs"}[tok]
        elif head == "fx" and tok == "nosp":
            lay.sp = False
        elif head == "fx" and tok == "fadam":
            lay.fadam = True
        elif head == "fx" and tok == "acc32":
            lay.fp32_accum = True
        elif head == "fx" and tok in ("nccl", "ce"):
            lay.transport = {"nccl": "nccl", "ce": "copy_engine"}[tok]
        elif head == "fx" and tok in ("rsel", "rfull"):
            lay.recompute = {"rsel": "selective", "rfull": "full"}[tok]
        else:
            raise ValueError(f"layout {name!r}: unknown part {tok!r} for a {head} layout")
    if head == "native" and not any(t.startswith("tp") for t in tokens):
        raise ValueError(f"layout {name!r}: native needs its tensor-parallel size, e.g. native-tp4")
    lay.m = m if m is not None else (pp_microbatches if lay.pp > 1 else 1)
    lay.sp = lay.sp and lay.tp > 1
    return lay


def check_layout(lay: Layout, world: int, cfg: GPTConfig, batch: int) -> Optional[str]:
    """Why ``lay`` cannot run here, or None."""
    if lay.kind in ("eager", "compile") and world != 1:
        return (f"{lay.name} runs the whole model in one process; world size is {world}: run it in a separate "
                f"one-process job (python benchmarks/end_to_end.py --layouts {lay.name})")
    if lay.world != world:
        return (f"{lay.name} needs dp·pp·tp = {lay.dp}·{lay.pp}·{lay.tp} = {lay.world} processes, but the world "
                f"size is {world} (torchrun --nproc-per-node)")
    if batch % (lay.dp * lay.m):
        return f"{lay.name}: global batch {batch} is not divisible by dp·microbatches = {lay.dp}·{lay.m}"
    if lay.kind == "native" and (cfg.n_head % lay.tp or cfg.vocab_size % lay.tp or cfg.block_size % lay.tp):
        return f"{lay.name}: tp {lay.tp} must divide the heads ({cfg.n_head}), vocabulary and sequence length"
    if lay.kind == "fx" and lay.pp * lay.v > cfg.n_layer:
        return f"{lay.name}: pp·v = {lay.pp * lay.v} chunks but only {cfg.n_layer} layers"
    return None


# ---- bf16 parameters, fp32 master weights ----------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered; a plain tensor itself)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's local data: a DTensor's shard on this rank, a plain tensor itself."""
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


class MasterWeightAdamW:
    """Megatron's mixed precision: the model keeps its (bf16) parameters; this keeps fp32
    master copies and fp32 gradient buffers. ``step()`` copies the (already clipped)
    gradients into the buffers, runs AdamW on the masters and copies them back into the
    model's parameters. DTensor parameters are handled through their local shards."""

    def __init__(self, params, lr: float, fused: bool):
        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            self.model_data = [_local(p.detach()) for p in self.params]
            self.masters = [t.to(torch.float32, copy=True) for t in self.model_data]
            self.grads = [torch.zeros_like(m) for m in self.masters]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=fused)

    @staticmethod
    def _grad(p):
        from torch.distributed.tensor import DTensor
        g = p.grad
        if isinstance(g, DTensor):
            if tuple(g.placements) != tuple(p.placements):   # e.g. a Partial gradient of a Replicate weight
                g = g.redistribute(p.device_mesh, p.placements)
            return g.to_local()
        return g

    @torch.no_grad()
    def step(self):
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if live:
            torch._foreach_copy_([self.grads[i] for i in live], [self._grad(self.params[i]) for i in live])
        have = set(live)
        for i, m in enumerate(self.masters):
            m.grad = self.grads[i] if i in have else None
        self.opt.step()
        torch._foreach_copy_(self.model_data, self.masters)
        for p in self.params:
            p.grad = None


# ---- building each framework's model ---------------------------------------------------------
@dataclass
class Job:
    """What the training loop needs from a layout."""
    params: list
    fwd_bwd: Callable[[], torch.Tensor]    # forward + backward of the global batch; returns the loss
    clip: Callable[[], object]
    keep: list                             # objects to free after the layout
    norm: Optional[Callable[[], torch.Tensor]] = None   # the gradient norm without clipping (-fadam)


def plain_model(cfg: GPTConfig, dev, dtype) -> GPT:
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(cfg)
    return model.to(dtype)


def accumulate(fn, ids, labels, m, context=None):
    """forward + backward over m microbatches of (ids, labels); returns the mean loss."""
    import contextlib
    id_chunks, label_chunks = ids.chunk(m), labels.chunk(m)

    def fwd_bwd():
        total = None
        with (context() if context else contextlib.nullcontext()):
            for x, y in zip(id_chunks, label_chunks):
                loss = fn(x, y)
                (loss / m).backward()
                val = _local(loss.detach()) / m
                total = val if total is None else total + val
        return total
    return fwd_bwd


def build_eager(lay, cfg, dev, dtype, ids, labels, **_):
    model = plain_model(cfg, dev, dtype)
    mode = lay.compile if isinstance(lay.compile, str) else None
    fn = torch.compile(model, mode=mode) if lay.kind == "compile" else model
    params = list(model.parameters())
    return Job(params, accumulate(fn, ids, labels, lay.m),
               lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), [model, fn])


def _local_heads_forward(self, x):
    """examples/gpt.py's SelfAttention.forward with ``view(B, T, -1, hd)``: after a
    column-parallel q/k/v each rank holds n_head / tp heads. Same math otherwise."""
    B, T, C = x.shape
    hd = self.head_dim
    q = self.q(x).view(B, T, -1, hd).transpose(1, 2)
    k = self.k(x).view(B, T, -1, hd).transpose(1, 2)
    v = self.v(x).view(B, T, -1, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       dropout_p=self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(B, T, -1)
    return self.resid_drop(self.proj(y))


def build_native(lay, cfg, dev, dtype, ids, labels, meshes, **_):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)
    mesh = meshes((lay.tp,), ("tp",))
    model = plain_model(cfg, dev, dtype)
    block_plan = {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        block.attn.head_dim = cfg.n_embd // cfg.n_head
        block.attn.forward = types.MethodType(_local_heads_forward, block.attn)
        parallelize_module(block, mesh, block_plan)
    parallelize_module(model, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        # loss parallel: logits stay sharded over the vocabulary, cross-entropy runs on the shards
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    # wpe: replicated weight; its (T, C) output is cut to this rank's sequence shard (no communication;
    # the backward all-gathers the gradient), to add to wte's sequence-sharded output.
    distribute_module(
        model.wpe, mesh,
        input_fn=lambda mod, inputs, m: tuple(DTensor.from_local(t, m, [Replicate()], run_check=False)
                                              for t in inputs),
        output_fn=lambda mod, out, m: out.redistribute(m, [Shard(0)]).to_local())
    for i in range(len(model.blocks)):
        model.blocks[i] = torch.compile(model.blocks[i])
    params = list(model.parameters())
    return Job(params, accumulate(model, ids, labels, lay.m, context=loss_parallel),
               lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), [model])


def build_fx(lay, cfg, dev, dtype, ids, labels, meshes, ref_state=None, **_):
    mesh = meshes((lay.dp, lay.pp, lay.tp), ("dp", "pp", "tp"))
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    pm = fxmegatron.parallelize(model, mesh, (ids, labels), sequence_parallel=lay.sp, recompute=lay.recompute,
                                microbatches=lay.m, virtual_stages=lay.v, schedule=lay.schedule, fuse=lay.fuse,
                                compile=lay.compile, tp_comm_overlap=lay.overlap,
                                tp_comm_transport=lay.transport, state_dict=ref_state,
                                grad_accum_dtype=torch.float32 if lay.fp32_accum else None)
    return Job(list(pm.parameters()), lambda: pm.train_step(ids, labels), lambda: pm.clip_grad_norm_(1.0), [pm],
               norm=pm.grad_norm)


BUILDERS = {"eager": build_eager, "compile": build_eager, "native": build_native, "fx": build_fx}


# ---- profile breakdown: unions of kernel intervals -------------------------------------------
def merge(intervals):
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(intervals):
    return sum(e - s for s, e in merge(intervals))


def minus(a, b):
    """The parts of the union of ``a`` that the union of ``b`` does not cover."""
    a, b = merge(a), merge(b)
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        cur, k = s, j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append([cur, b[k][0]])
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append([cur, e])
    return out


def kernel_class(name: str) -> str:
    """"collective", "p2p" or "compute" for a GPU kernel name."""
    n = name.lower()
    if "nccl" not in n:
        return "compute"
    if any(w in n for w in ("sendrecv", "send", "recv")):
        return "p2p"
    return "collective"     # AllReduce, AllGather, ReduceScatter, Broadcast, ...


def breakdown(trace_events) -> Optional[Dict[str, float]]:
    """Compute / exposed communication / bubble / idle, in ms, of the step marked STEP_MARK
    in a chrome trace's events; None without GPU kernels (a CPU run)."""
    marks = [e for e in trace_events if e.get("name") == STEP_MARK and e.get("ph") == "X"
             and e.get("cat") == "user_annotation"]
    if not marks:
        return None
    w0 = float(marks[0]["ts"])
    w1 = w0 + float(marks[0]["dur"])
    by_class = {"compute": [], "collective": [], "p2p": []}
    for e in trace_events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        s, t = max(float(e["ts"]), w0), min(float(e["ts"]) + float(e.get("dur", 0)), w1)
        if t > s:
            by_class[kernel_class(e.get("name", "")) if e["cat"] == "kernel" else "compute"].append((s, t))
    every = by_class["compute"] + by_class["collective"] + by_class["p2p"]
    if not every:
        return None
    ms = 1e-3    # trace times are in microseconds
    return {"step_ms_profiled": (w1 - w0) * ms,
            "compute_ms": length(by_class["compute"]) * ms,
            "exposed_comm_ms": length(minus(by_class["collective"], by_class["compute"])) * ms,
            "bubble_ms": length(minus(by_class["p2p"], by_class["compute"])) * ms,
            "idle_ms": ((w1 - w0) - length(every)) * ms}


# ---- running one layout -----------------------------------------------------------------------
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_layout(lay, cfg, args, dev, dtype, ids, labels, meshes, ref_state, peak_tflops, profile=True):
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    job = BUILDERS[lay.kind](lay, cfg, dev, dtype, ids, labels, meshes=meshes, ref_state=ref_state)
    build_s = time.perf_counter() - t0
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    norms = []
    if lay.fadam:
        from fxmegatron.optim import FusedAdamW, clip_coefficient
        opt = FusedAdamW(job.params, lr=args.lr)      # torch.optim.AdamW's defaults otherwise

        def step():
            loss = job.fwd_bwd()
            norms.append(job.norm())
            opt.step(clip_coefficient(norms[-1], 1.0))    # the clip inside the optimizer's pass
            return loss.detach()
    else:
        opt = MasterWeightAdamW(job.params, lr=args.lr, fused=dev.type == "cuda")

        def step():
            loss = job.fwd_bwd()
            norms.append(job.clip())   # the gradient norm before clipping
            opt.step()
            return loss.detach()

    losses = []
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(step())
    _sync(dev)
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        _sync(dev)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    times = sorted(slowest.tolist())
    step_s = times[len(times) // 2]

    prof = None
    if profile and not args.no_profile:
        prof = profiled_step(step, lay, args, dev, rank)

    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0],
                        dtype=torch.float64, device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    vals = [float(x) for x in losses]
    first_norm = _full(norms[0]).item() if norms else None
    row = {"layout": lay.name, **rates(step_s, args, cfg, world, peak_tflops),
           "peak_gib": peak.item() if dev.type == "cuda" else None,
           "loss_first": vals[0], "loss_last": vals[-1], "losses": vals, "grad_norm_first": first_norm,
           "build_s": build_s, "warmup_s": warmup_s,
           "step_ms_all": [t * 1e3 for t in times], "microbatches": lay.m, "layout_spec": asdict(lay)}
    if prof:
        row.update(prof)
    del job, opt, step, losses, norms
    return row


def profiled_step(step, lay, args, dev, rank):
    """One more step; rank 0 runs it under torch.profiler, writes the trace and returns the breakdown."""
    if rank != 0:
        _sync(dev)
        dist.barrier()
        step()
        _sync(dev)
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as p:
        _sync(dev)
        dist.barrier()
        with record_function(STEP_MARK):
            step()
            _sync(dev)
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        path = os.path.join(args.profile_dir, f"{lay.name}.rank0.json")
        p.export_chrome_trace(path)
    else:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        p.export_chrome_trace(path)
    try:
        with open(path) as f:
            trace = json.load(f)
    finally:
        if not args.profile_dir:
            os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = breakdown(events)
    if args.profile_dir:
        out = dict(out or {}, trace=path)
    return out


def run_guarded(lay, cfg, args, dev, dtype, ids, labels, meshes, ref_state, peak_tflops, profile=True):
    """run_layout, with every rank learning whether any rank failed."""
    rank = dist.get_rank()
    row, err, tb = None, None, None
    if args.hang_dump:     # a layout that hangs (in a collective, say) shows where, every rank
        faulthandler.dump_traceback_later(args.hang_dump, exit=False)
    try:
        row = run_layout(lay, cfg, args, dev, dtype, ids, labels, meshes, ref_state, peak_tflops, profile)
    except Exception as exc:    # noqa: BLE001 -- an OOM or a framework error becomes an "error" row
        err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        tb = traceback.format_exc()
        del exc
    finally:
        if args.hang_dump:
            faulthandler.cancel_dump_traceback_later()
    failed = torch.tensor([0.0 if err is None else 1.0], device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        first = next(i for i, e in enumerate(errs) if e is not None)
        if rank == first:
            print(f"[rank {rank}] layout {lay.name} failed:\n{tb}", file=sys.stderr, flush=True)
        row = {"layout": lay.name, "error": f"rank {first}: {errs[first]}"}
        forget_failure(meshes)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def forget_failure(meshes):
    """After a failed layout: sends/receives of the broken step may still be pending in its
    groups, so later layouts get new process groups. (Each pipeline runner reports failures
    under its own store key, so the old failure is not seen again.)"""
    dist.barrier()
    meshes.cache_clear()


# ---- set-up, reference, output ------------------------------------------------------------------
def matmul_tflops(dev, n=8192, warmup=5, iters=20):
    """Median bf16 n×n×n matmul throughput on this GPU, TFLOP/s."""
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ b
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / times[len(times) // 2] / 1e12


def reference_losses(cfg, args, dev, dtype, ids, labels, steps=2):
    """The plain model's first losses and first gradient norm (the --check reference) and its
    initial weights (on CPU)."""
    model = plain_model(cfg, dev, dtype)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    opt = MasterWeightAdamW(model.parameters(), lr=args.lr, fused=dev.type == "cuda")
    losses, norms = [], []
    for _ in range(steps):
        loss = model(ids, labels)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        losses.append(loss.item())
    del model, opt
    gc.collect()
    return losses, norms[0], state


def make_batch(cfg, batch, dev, seed=0):
    """The synthetic batch: random tokens, labels = the next token."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return seq[:, :-1].contiguous().to(dev), seq[:, 1:].contiguous().to(dev)


def _fmt(x, spec, width):
    return f"{'-':>{width}}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{width}{spec}}"


def print_table(rows):
    head = (f"{'layout':18} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s/GPU':>11} {'MFU':>6} {'peak GiB':>8} "
            f"{'loss first->last':>17} {'compute ms':>10} {'exp.comm ms':>11} {'bubble ms':>9} {'idle ms':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:18} error: {r['error']}")
            continue
        step = r["step_ms"]

        def part(key, width):
            v = r.get(key)
            if v is None:
                return f"{'-':>{width}}"
            ref = r.get("step_ms_profiled", step)
            return f"{v:{width - 5}.1f}({100 * v / ref:2.0f}%)" if ref else f"{v:{width}.1f}"
        mfu = r.get("mfu")
        mfu = f"{'-':>6}" if mfu is None else f"{100 * mfu:5.1f}%"
        print(f"{r['layout']:18} {step:9.1f} {r['tokens_per_s']:10.0f} {r['tflops_per_gpu']:11.2f} "
              f"{mfu} {_fmt(r['peak_gib'], '.2f', 8)} "
              f"{r['loss_first']:8.4f}->{r['loss_last']:<7.4f} "
              f"{part('compute_ms', 10)} {part('exposed_comm_ms', 11)} {part('bubble_ms', 9)} {part('idle_ms', 8)}")
    if any("compute_ms" in r for r in rows):
        print("(breakdown: one profiled step on rank 0; % of that step's wall time, printed as step_ms_profiled "
              "in --json)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt1.3b", choices=[k for k in MODELS if k != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="8 layers, h 64, 4 heads, s 64, V 512, batch 16 (CPU smoke)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches of layouts with pp > 1 and no -mN")
    ap.add_argument("--layouts", default="eager,compile,fx")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the layouts this many times, every other round in reverse order; a row's step "
                         "time is the median over all its rounds' timed steps")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="model parameters (default bfloat16; float32 with --check)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="MFU reference instead of the measured bf16 matmul")
    ap.add_argument("--check", action="store_true",
                    help=f"compare every layout's first losses with the plain model's (float32, rel. {CHECK_RTOL})")
    ap.add_argument("--json", default="", help="write every row and the run's settings here (rank 0)")
    ap.add_argument("--profile-dir", default="", help="write a chrome trace per layout (rank 0)")
    ap.add_argument("--no-profile", action="store_true", help="no profiled step (no breakdown)")
    ap.add_argument("--hang-dump", type=float, default=0, metavar="SECONDS",
                    help="print every thread's Python stack (each rank) when a layout runs longer than this")
    args = ap.parse_args(argv)
    base = MODELS["tiny" if args.tiny else args.model]
    for key, val in zip(("layers", "hidden", "heads", "seq", "vocab", "global_batch"), base):
        if getattr(args, key) is None:
            setattr(args, key, val)
    if args.dtype is None:
        args.dtype = "float32" if args.check else "bfloat16"
    return args


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:        # plain `python end_to_end.py`: a one-process group
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        launcher = "python"
    else:
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])}"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lead = rank == 0
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.hidden, dropout=0.0, tie_embeddings=False, bias=True)

    problems = []
    if args.check and args.dtype != "float32":
        problems.append(f"--check compares losses to {CHECK_RTOL} relative: use --dtype float32")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        problems.append("--steps and --rounds must be >= 1 and --warmup >= 0")
    if args.hidden % args.heads:
        problems.append(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    layouts = []
    for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
        try:
            lay = parse_layout(name, args.microbatches)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        why = check_layout(lay, world, cfg, args.global_batch)
        if why:
            problems.append(why)
        layouts.append(lay)
    if not layouts:
        problems.append("no layouts given (--layouts)")
    if problems:
        # only rank 0 fails: torchrun ends the others as soon as one fails, maybe before rank 0 printed
        if lead:
            print("end_to_end.py: error:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
            return 2
        return 0

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rc = bench(args, cfg, layouts, dev, launcher, lead, world)
    if rc:
        # A failed layout can leave sends/receives pending (a broken pipeline step); tearing the
        # process group down then may abort the process. Leave with the exit code instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    dist.destroy_process_group()
    return rc


def bench(args, cfg, layouts, dev, launcher, lead, world):
    from torch.distributed.device_mesh import init_device_mesh
    dtype = getattr(torch, args.dtype)

    @functools.lru_cache(maxsize=None)
    def meshes(shape, names):   # one mesh (and its process groups) per shape, shared by the layouts
        return init_device_mesh(dev.type, shape, mesh_dim_names=names)

    peak_tflops = args.peak_tflops
    if peak_tflops is None and dev.type == "cuda":
        t = torch.tensor([matmul_tflops(dev)], dtype=torch.float64, device=dev)
        dist.broadcast(t, src=0)
        peak_tflops = t.item()
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    ids, labels = make_batch(cfg, args.global_batch, dev)
    n_params = _count_params(cfg)
    if lead:
        print(f"command: {launcher} {' '.join(sys.argv)}")
        print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
              f"device {dev_name}, world size {world} ({dist.get_backend()})")
        print(f"GPT l={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.block_size} V={cfg.vocab_size} "
              f"({n_params / 1e6:,.1f} M parameters, untied), global batch {args.global_batch}, {args.dtype} "
              f"parameters + fp32 master weights, AdamW lr {args.lr:g}, clip 1.0; {args.warmup} warm-up + "
              f"{args.steps} timed steps")
        if peak_tflops:
            print(f"bf16 8192^3 matmul: {peak_tflops:.1f} TFLOP/s per GPU"
                  + (" (--peak-tflops)" if args.peak_tflops else " (measured, median of 20)"))
        print(flush=True)

    ref_losses, ref_norm, ref_state = None, None, None
    if args.check:
        ref_losses, ref_norm, ref_state = reference_losses(cfg, args, dev, dtype, ids, labels,
                                                 steps=min(2, args.warmup + args.steps))
        if lead:
            print(f"check: plain model's first losses {[round(x, 6) for x in ref_losses]}, first gradient norm "
                  f"{ref_norm:.6g}", flush=True)

    runs = {lay.name: [] for lay in layouts}
    for r in range(args.rounds):
        # every other round backwards: each layout runs early and late alike, so a drift of the
        # GPU's clock (it runs at its power limit) does not favour the layout that runs first
        for lay in (layouts if r % 2 == 0 else layouts[::-1]):
            row = run_guarded(lay, cfg, args, dev, dtype, ids, labels, meshes,
                              ref_state if lay.kind == "fx" else None, peak_tflops, profile=r == args.rounds - 1)
            runs[lay.name].append(row)
            if lead:
                tag = f"[round {r + 1}/{args.rounds}] " if args.rounds > 1 else ""
                if "error" in row:
                    print(f"{tag}{lay.name}: error: {row['error']}", flush=True)
                else:
                    print(f"{tag}{lay.name}: {row['step_ms']:.1f} ms/step, loss {row['loss_first']:.4f} -> "
                          f"{row['loss_last']:.4f} (build {row['build_s']:.1f} s, warm-up {row['warmup_s']:.1f} s)",
                          flush=True)
    rows = [merge_rounds(runs[lay.name], args, cfg, world, peak_tflops) for lay in layouts]

    failed_check = False
    if lead:
        print()
        print_table(rows)
        for r in rows:
            if "step_ms_rounds" in r:
                print(f"  {r['layout']}: each round's median " + " / ".join(f"{t:.1f}" for t in r["step_ms_rounds"])
                      + " ms")
    if args.check:
        if lead:
            print(f"\ncheck against the plain model (losses of the first {len(ref_losses)} steps, gradient norm of the "
                  f"first; tolerance {CHECK_RTOL} relative):")
        for r in rows:
            if "error" in r:
                failed_check = True
                if lead:
                    print(f"  {r['layout']:18} FAILED: {r['error']}")
                continue
            diffs = [abs(a - b) for a, b in zip(r["losses"], ref_losses)]
            rel = max(d / abs(b) for d, b in zip(diffs, ref_losses))
            norm_rel = abs(r["grad_norm_first"] - ref_norm) / abs(ref_norm)
            ok = rel <= CHECK_RTOL and norm_rel <= CHECK_RTOL
            r["check"] = {"max_abs_diff": max(diffs), "max_rel_diff": rel, "grad_norm_rel_diff": norm_rel, "ok": ok}
            failed_check |= not ok
            if lead:
                print(f"  {r['layout']:18} losses {[round(x, 6) for x in r['losses'][:len(ref_losses)]]} "
                      f"max |diff| {max(diffs):.2e} (rel {rel:.2e}); gradient norm {r['grad_norm_first']:.6g} "
                      f"(rel {norm_rel:.2e}) {'ok' if ok else 'FAILED'}")
        if lead:
            print("check: " + ("FAILED" if failed_check else "passed"), flush=True)
    if lead and args.json:
        with open(args.json, "w") as f:
            json.dump({"command": f"{launcher} {' '.join(sys.argv)}", "torch": torch.__version__, "device": dev_name,
                       "world_size": world, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "args": vars(args), "matmul_tflops": peak_tflops, "reference_losses": ref_losses,
                       "reference_grad_norm": ref_norm,
                       "rows": rows}, f, indent=1)
    if lead:
        sys.stdout.flush()
    dist.barrier()      # no rank leaves (torchrun would end the others) before rank 0 has printed
    if failed_check:
        return 1
    return 1 if any("error" in r for r in rows) else 0


def rates(step_s, args, cfg, world, peak_tflops):
    """A row's step time and what follows from it: tokens/s, model TFLOP/s per GPU, MFU."""
    tflops = model_flops(args.global_batch, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.vocab_size) \
        / step_s / world / 1e12
    return {"step_ms": step_s * 1e3, "tokens_per_s": args.global_batch * cfg.block_size / step_s,
            "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops if peak_tflops else None}


def merge_rounds(rows, args, cfg, world, peak_tflops):
    """One row from a layout's rounds: the median over all their timed steps, the last round's
    profile, losses and memory; each round's own median in ``step_ms_rounds``."""
    if len(rows) == 1 or any("error" in r for r in rows):
        return next((r for r in rows if "error" in r), rows[-1])
    row = dict(rows[-1])
    steps = sorted(t for r in rows for t in r["step_ms_all"])
    row["step_ms_all"] = steps
    row["step_ms_rounds"] = [r["step_ms"] for r in rows]
    row.update(rates(steps[len(steps) // 2] / 1e3, args, cfg, world, peak_tflops))
    row["peak_gib"] = max((r["peak_gib"] for r in rows if r["peak_gib"] is not None), default=None)
    return row


def _count_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


if __name__ == "__main__":
    sys.exit(main())
