"""The memory and schedule figures of a dry-run plan (``fxmegatron.train.plan``): bytes a chunk
keeps for its backward, measured on meta tensors; how many microbatches a schedule keeps in
flight, and its timeline as text; what gradients and the optimizer hold per parameter.

Activations are not modelled by a formula: each chunk of the rank's transformed graph runs
forward on the meta device under ``torch.autograd.graph.saved_tensors_hooks``, so what is
counted is what autograd's own formulas save, op by op, through the same passes (tensor and
sequence parallelism, recompute regions) as the real program, without allocating anything.
Storages are counted once (views share them) and parameters' storages not at all, as
``runtime.memory.saved_bytes`` counts a real run.

Some ops take another form on a real device than on meta, and keep other tensors:

* ``scaled_dot_product_attention`` is a fused kernel on GPUs (flash or memory-efficient) and
  on CPUs (flash), which never stores the s×s scores; on meta it decomposes into the math
  path, which does. It runs here as the fused kernel (its CPU flash form, whose meta kernel
  saves what the GPU kernels save: q, k, v, the output, the log-sum-exp and the mask; with
  grouped kv heads, ``enable_gqa``, the same with k and v unrepeated);
* the vocab-parallel cross-entropy runs a Triton kernel where fxmegatron's kernels run (GPUs,
  or the CPU under ``TRITON_INTERPRET=1``: ``codegen.where_kernels_run``), which keeps the
  logits and three vectors, and elsewhere (meta included) a torch form with fp32 copies of
  the logits. With ``kernels`` it runs here as the kernel's op (``vocab_ce``, whose meta
  form saves what the kernel saves).

A recomputed region keeps only its inputs, but its backward runs its forward again with
autograd on: that region's activations exist, one region at a time, while it runs. Each
region's body is measured too, and the largest is reported per chunk.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from fxmegatron.kernels.cross_entropy import fused_vocab_cross_entropy
from fxmegatron.kernels.multi_tensor import flat_offsets
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.recompute import Recomputed
from fxmegatron.schedules import Schedule, simulate

aten = torch.ops.aten

OPTIMIZERS = ("adamw", "fused_adamw")
OPTIMIZER_NOTES = {
    "adamw": "torch.optim.AdamW: exp_avg and exp_avg_sq in the parameters' dtype, a 4-byte step per tensor",
    "fused_adamw": "fxmegatron.optim.FusedAdamW: fp32 master, exp_avg and exp_avg_sq (12 bytes per element, "
                   "each tensor padded to 64 elements)",
}


class _GroupedFlash(torch.autograd.Function):
    """What a fused kernel with grouped kv heads keeps: q, the kv heads as they are, the output
    and the log-sum-exp (the CPU flash op has no ``enable_gqa`` to measure)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as a fused kernel runs it (see the module docstring)."""
    if enable_gqa and attn_mask is None and dropout_p == 0 and q.dim() == 4:
        return _GroupedFlash.apply(q, k, v)
    if enable_gqa or dropout_p > 0 or q.dim() != 4:
        return aten.scaled_dot_product_attention.default(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                         enable_gqa=enable_gqa)
    return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, dropout_p, is_causal,
                                                                    attn_mask=attn_mask, scale=scale)[0]


def kernel_cross_entropy(logits, target, vocab_start: int, group_name: str, reduction: int = 1,
                         ignore_index: int = -100, out_dtype=None, reuse_logits=False, grad_in_graph=False):
    """``vocab_parallel_cross_entropy`` as its kernel runs it. Only the count of saved bytes is
    read on meta, and the reduction of the per-token losses keeps no tensor of any size."""
    loss = fused_vocab_cross_entropy(logits, target, vocab_start, group_name, ignore_index)
    return (loss if reduction == 0 else loss.sum()).to(out_dtype or logits.dtype)


class DeviceFormRun(fx.Interpreter):
    """Runs a graph on meta with each op in the form it takes on the device (module docstring),
    and measures, beside it, what each recomputed region keeps while its backward runs it."""

    def __init__(self, gm: fx.GraphModule, kernels: bool, params: set):
        super().__init__(gm)
        self.kernels, self.params = kernels, params
        self.recompute_peak = 0

    def call_function(self, target, args, kwargs):
        if target is aten.scaled_dot_product_attention.default:
            return fused_attention(*args, **kwargs)
        if self.kernels and target is vocab_parallel_cross_entropy:
            return kernel_cross_entropy(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        mod = self.fetch_attr(target)
        if isinstance(mod, Recomputed):
            ins = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
            skip = self.params | {_storage(a)[0] for a in ins if isinstance(a, torch.Tensor)}
            seen: Dict[int, int] = {}
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_counter(seen, skip), lambda t: t):
                DeviceFormRun(mod.body, self.kernels, self.params).run(*ins)
            self.recompute_peak = max(self.recompute_peak, sum(seen.values()))
        return super().call_module(target, args, kwargs)


def _counter(seen: Dict[int, int], skip: set):
    def pack(t):
        key, n = _storage(t)
        if key not in skip:
            seen[key] = n
        return t
    return pack


def _storage(t: torch.Tensor) -> Tuple[int, int]:
    # on meta every data_ptr is 0: the StorageImpl's address tells storages apart
    st = t.untyped_storage()
    return st._cdata, st.nbytes()


def _tensors(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def saved_by_chunks(modules: Sequence[fx.GraphModule], boundary_grad: Sequence[Sequence[bool]],
                    batch_inputs: Sequence[Sequence[int]], microbatch: Sequence,
                    kernels: bool = True) -> Tuple[List[int], List[int]]:
    """(bytes each chunk keeps per microbatch until its backward, the most a recomputed region of
    it holds while its backward recomputes it). Kept: what autograd saves in the forward and,
    between pipeline chunks, the boundary inputs and outputs (the runtime holds both until the
    chunk's backward). ``modules`` run in order on meta, each fed the previous one's outputs (a
    leaf asking for a gradient where ``boundary_grad`` says one flows back) and its
    ``batch_inputs`` of the flat ``microbatch`` (meta tensors); ``kernels``: whether
    fxmegatron's kernels run where the program will (module docstring)."""
    kept, transient, carried = [], [], []
    for k, gm in enumerate(modules):
        params = {_storage(p)[0] for p in gm.parameters()}
        seen: Dict[int, int] = {}
        grads = boundary_grad[k - 1] if k else []
        boundary = [t.detach().requires_grad_(g) for t, g in zip(carried, grads)]
        args = boundary + [microbatch[i] for i in batch_inputs[k]]
        run = DeviceFormRun(gm, kernels, params)
        with torch.autograd.graph.saved_tensors_hooks(_counter(seen, params), lambda t: t):
            out = run.run(*args)
        if k < len(modules) - 1:
            for t in boundary + _tensors(out):
                key, n = _storage(t)
                seen[key] = n
            carried = _tensors(out)
        kept.append(sum(seen.values()))
        transient.append(run.recompute_peak)
    return kept, transient


def in_flight(schedule: Optional[Schedule], rank: int, saved: Mapping[int, int]) -> Tuple[int, Dict[int, int]]:
    """(the most bytes of activations rank ``rank`` holds at once, the most microbatches in
    flight per chunk of the rank), from the order of its computes: a forward of (i, c) adds
    chunk c's bytes, its backward frees them. Without a schedule one microbatch at a time
    (gradient accumulation runs each microbatch's backward before the next forward)."""
    if schedule is None:
        return sum(saved.values()), {c: 1 for c in saved}
    live = {c: 0 for c in saved}
    peak = dict(live)
    held = most = 0
    for a in schedule.computes(rank):
        step = 1 if a.kind == "F" else -1
        live[a.chunk] += step
        held += step * saved[a.chunk]
        peak[a.chunk] = max(peak[a.chunk], live[a.chunk])
        most = max(most, held)
    return most, peak


def grad_bytes(params: Sequence[Tuple[int, torch.dtype]], fp32_sums: bool) -> int:
    """``params``: (elements, dtype) of each trainable parameter. Autograd keeps a gradient
    of the parameter's dtype; with ``fp32_sums`` (grad_accum_dtype=float32 over several
    accumulations) the bf16/fp16 ones also have an fp32 sum in one flat, padded buffer."""
    total = sum(n * _size(dt) for n, dt in params)
    if fp32_sums:
        low = [n for n, dt in params if dt in (torch.bfloat16, torch.float16)]
        total += 4 * flat_offsets(low)[1]
    return total


def optimizer_bytes(params: Sequence[Tuple[int, torch.dtype]], optimizer: str) -> int:
    """The optimizer's state for the trainable ``params`` (see ``OPTIMIZER_NOTES``)."""
    if optimizer == "adamw":
        return sum(2 * n * _size(dt) + 4 for n, dt in params)
    if optimizer == "fused_adamw":
        return 12 * flat_offsets([n for n, _ in params])[1]
    raise ValueError(f"optimizer={optimizer!r}: expected one of {OPTIMIZERS}")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def byte_unit(n: int) -> Tuple[str, int]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return name, scale
    return "KiB", 2**10


def _id(i: int) -> str:
    return "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[i % 62]


def timeline_text(sched: Schedule, res=None, width: int = 160) -> str:
    """The simulated timeline as text, a row per pipeline rank (what ``schedules.draw`` draws):
    a forward of one chunk is one cell ``F<microbatch>``, its backward two cells ``B<mb>··``
    (backward = 2 × forward), ``.`` idle; with several chunks per rank, odd local chunks in
    lower case (``f``, ``b``). Microbatches are named 0-9, a-z, A-Z (then again); rows longer
    than ``width`` characters are cut."""
    res = res if res is not None else simulate(sched, 1.0, 2.0)
    cell = 1.0 / sched.v
    n = round(res.makespan / cell)
    digits = len(str(sched.p - 1))
    rows = []
    for r, events in enumerate(res.timeline):
        line = [". "] * n
        for start, end, a in events:
            k = round(start / cell)
            letter = a.kind if (a.chunk // sched.p) % 2 == 0 else a.kind.lower()
            line[k] = letter + _id(a.microbatch)
            for j in range(k + 1, round(end / cell)):
                line[j] = "··"
        rows.append((f"  rank {r:>{digits}} |", "".join(line)))
    room = (width - len(rows[0][0])) // 2
    if n <= room:
        return "\n".join(head + body for head, body in rows)
    return "\n".join(head + body[:2 * room] + " …" for head, body in rows) + f"\n  (the first {room} of {n} cells)"
