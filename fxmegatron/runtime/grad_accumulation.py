"""Gradients summed over a step's microbatches in fp32: Megatron's ``main_grad``.

Autograd accumulates a parameter's gradient in the parameter's own dtype. Over m
microbatches a bf16 gradient is rounded to 8 bits of mantissa m - 1 times, and the sum of
many small contributions drifts (each add of a small term to a large sum may round it
away). Here a post-accumulate-grad hook moves each microbatch's gradient into an fp32
sum and frees it; at the parameter's last accumulation of the step the sum, rounded
once, goes back into ``.grad``. The optimizer and the data-parallel reduction then see
one rounding instead of m - 1.

The hook is registered before the data-parallel ``GradSync`` one, so the bucket that
GradSync launches at a parameter's last accumulation reads the rounded sum. The fp32 sums
are one flat buffer (4 bytes per low-precision parameter), made at the step's first
accumulation and dropped when the step ends.

The adds are batched. A parameter's hook only sets its gradient aside (and frees
``.grad``); at the end of each backward pass one callback adds all of them into one flat
fp32 buffer, with one multi-tensor Triton kernel per gradient dtype (``acc_multi``: each
program adds a chunk of one tensor, whose address it reads from a table). On gpt1.3b at pp2
with 8 microbatches, torch's add of a bf16 tensor into an fp32 one, one per parameter and
microbatch, took 27.7 ms of a 199 ms step (docs/TRAINING.md): it is not vectorised when
the dtypes differ. A parameter's last accumulation is added at once, in its hook, so that
``.grad`` holds the rounded sum when the data-parallel hook after it reads it. Where
kernels do not run (CPU without the interpreter) the callback uses ``torch._foreach_add_``.

Not done: Megatron's gradient-accumulation fusion, where the weight-gradient GEMM adds
straight into the fp32 buffer (cuBLAS with beta = 1 and an fp32 output); here each
microbatch's bf16 weight gradient is written, then added.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from fxmegatron.kernels.multi_tensor import chunk_tables, config, flat_offsets
from fxmegatron.errors import GradAccumError



def check_grad_accum_dtype(dtype) -> Optional[torch.dtype]:
    if dtype not in (None, torch.float32):
        raise GradAccumError(f"parallelize(grad_accum_dtype={dtype!r}): expected None (the parameters' dtype, "
                             "as autograd accumulates) or torch.float32")
    return dtype


_SRC = '''
@triton.jit
def acc_multi(chunks_ptr, meta_ptr, addr_ptr, sum_ptr, ref_ptr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
              ITERS: tl.constexpr):
    # chunks: [C, 2] int64 (entry, first element); meta: [T, 2] int64 (offset in the flat fp32 sum,
    # numel); addr: [T] int64 gradient addresses; ref: a tensor of the gradients' dtype, whose
    # pointer type the addresses are cast to
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.load(chunks_ptr + 2 * pid + 1)
    g_ptr = tl.load(addr_ptr + t).to(ref_ptr.dtype)
    base = tl.load(meta_ptr + 2 * t)
    n = tl.load(meta_ptr + 2 * t + 1)
    if ALIGNED:     # every address 16-byte aligned; chunk starts and offsets multiples of 16
        g_ptr = tl.multiple_of(g_ptr, 16)
        start = tl.multiple_of(start, 16)
        base = tl.multiple_of(base, 16)
    if start + BLOCK * ITERS <= n:      # a whole chunk: no masks, vector loads
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + offs).to(tl.float32)
            s = tl.load(sum_ptr + base + offs)
            tl.store(sum_ptr + base + offs, s + g)
    else:
        for i in range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sum_ptr + base + offs, mask=mask, other=0.0)
            tl.store(sum_ptr + base + offs, s + g, mask=mask)
'''


def _kernel():
    from fxmegatron.codegen.kernel_cache import compile_source
    return compile_source(_SRC, "acc_multi")


class Fp32GradAccumulator:
    """Sums the step's gradients of the bf16/fp16 ``params`` in fp32 (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], uses: Dict[int, int]):
        self.params = [p for p in params if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
        self.uses = uses                     # id(param) -> accumulations per microbatch (pipeline chunks)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.offsets, self._total = flat_offsets([p.numel() for p in self.params])
        self._flat: Optional[torch.Tensor] = None           # the step's fp32 sums, made at first use
        self._tables: Dict[Tuple, Tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._expected: List[int] = []
        self._count: List[int] = []
        self._pending: List[Tuple[int, torch.Tensor]] = []  # (parameter, gradient set aside)
        self._queued = False
        self.active = False

    def start(self, microbatches: int) -> None:
        """Arm for one step of ``microbatches``."""
        self._expected = [microbatches * self.uses.get(id(p), 1) for p in self.params]
        self._count = [0] * len(self.params)
        self._flat = None
        self._pending = []
        self._queued = False
        self.active = True

    def _sum(self, i: int) -> torch.Tensor:
        p = self.params[i]
        if self._flat is None:
            self._flat = torch.zeros(self._total, dtype=torch.float32, device=p.device)
        return self._flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)

    def _hook(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        i = self._index[id(p)]
        self._count[i] += 1
        if self._count[i] < self._expected[i]:
            self._pending.append((i, p.grad))
            p.grad = None                    # autograd starts the next microbatch's gradient afresh
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        elif self._count[i] > 1:             # the last of several: the rounded sum, for the dp hook
            s = self._sum(i)
            s.add_(p.grad)
            p.grad = s.to(p.dtype)
        # one accumulation in all: autograd's gradient is already the sum, unrounded

    def _flush(self) -> None:
        """End of a backward pass: add the gradients set aside into their sums."""
        pending, self._pending, self._queued = self._pending, [], False
        if not pending:
            return
        from fxmegatron.codegen.where_kernels_run import table_kernels_run
        by_dtype: Dict[torch.dtype, List[Tuple[int, torch.Tensor]]] = {}
        for i, g in pending:
            by_dtype.setdefault(g.dtype, []).append((i, g if g.is_contiguous() else g.contiguous()))
        self._sum(pending[0][0])              # the flat buffer exists from here on
        kernel = table_kernels_run(self._flat)
        for items in by_dtype.values():
            if kernel:
                self._launch(items)
            else:
                torch._foreach_add_([self._sum(i) for i, _ in items], [g for _, g in items])

    def _launch(self, items: List[Tuple[int, torch.Tensor]]) -> None:
        block, iters, warps = config(self._flat.device)
        key = (items[0][1].dtype, tuple(i for i, _ in items))
        if key not in self._tables:          # the same chunk's parameters come back every microbatch
            self._tables[key] = chunk_tables([self.params[i].numel() for i, _ in items],
                                             [self.offsets[i] for i, _ in items], self._flat.device)
        chunks, meta, n = self._tables[key]
        if n == 0:
            return
        addrs = [g.data_ptr() for _, g in items]
        cuda = self._flat.is_cuda
        host = torch.tensor(addrs, dtype=torch.int64)
        table = host.pin_memory().to(self._flat.device, non_blocking=True) if cuda else host
        # Triton launches on the current device
        with torch.cuda.device(self._flat.device) if cuda else contextlib.nullcontext():
            _kernel()[(n,)](chunks, meta, table, self._flat, items[0][1], ALIGNED=not any(a & 15 for a in addrs),
                            BLOCK=block, ITERS=iters, num_warps=warps)

    def finish(self) -> None:
        """Write back the sums of parameters that got fewer accumulations than expected (a
        microbatch that did not reach them)."""
        self._flush()
        for i, p in enumerate(self.params):
            if 0 < self._count[i] < self._expected[i]:
                p.grad = self._sum(i).to(p.dtype)
        self._flat = None
        self.active = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
