"""AdamW's multi-tensor Triton kernel (``adamw_multi``) and its launch, for ``FusedAdamW``.

One launch covers the parameters of one parameter group and one dtype (an
``AdamWLaunch``): a multi-tensor apply, each program owning a chunk of
``BLOCK * ITERS`` elements of one tensor. Masters, ``m`` and ``v`` are each one flat
fp32 buffer (``fxmegatron.kernels.multi_tensor``'s layout). A program reads its
(tensor, chunk start) from a table built once on the device, and the addresses of that
tensor's gradient and parameter from a table of ``data_ptr()``\\ s cast to pointers in
the kernel. That table is rebuilt on the host each step and copied to the device (from
pinned memory, non-blocking) only when an address changed; the caching allocator
usually hands the gradients the same addresses step after step. A parameter without a
gradient has address 0 there and its programs return at once. The bias corrections
(``step_scalars``) are passed as scalars, or, in the rare step where parameters have
different step counts, travel in the table too.

Rounding: the kernel divides and takes the square root with IEEE rounding
(``tl.div_rn``, ``tl.sqrt_rn``), as torch's CUDA kernels do. Triton's interpreter
(3.9) truncates fp32 -> bf16 casts instead of rounding to nearest even, so under the
interpreter the kernel rounds bf16 stores itself, with integer ops on the fp32 bits;
on a GPU the ``.to(bfloat16)`` cast rounds to nearest even.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fxmegatron.codegen.kernel_cache import compile_source
from fxmegatron.kernels.multi_tensor import chunk_tables, config

_SRC = '''
@triton.jit
def _rtne_bf16(x):
    # fp32 -> bf16 rounded to nearest even on the fp32 bits (the interpreter truncates)
    u = x.to(tl.uint32, bitcast=True)
    r = u + (0x7FFF + ((u >> 16) & 1))
    r = tl.where(x != x, 0x7FC00000, r)
    return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_block(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, offs, foffs, n, scale, decay, beta1, omb1, beta2,
                 omb2, step_size, bc2_sqrt, eps, MASKED: tl.constexpr, RTNE_BF16: tl.constexpr):
    if MASKED:
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + foffs, mask=mask, other=0.0)
        m = tl.load(m_ptr + foffs, mask=mask, other=0.0)
        v = tl.load(v_ptr + foffs, mask=mask, other=0.0)
    else:
        g = tl.load(g_ptr + offs).to(tl.float32)
        w = tl.load(w_ptr + foffs)
        m = tl.load(m_ptr + foffs)
        v = tl.load(v_ptr + foffs)
    g = g * scale
    w = w * decay
    m = beta1 * m + omb1 * g
    v = beta2 * v + omb2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = w - tl.div_rn(step_size * m, denom)
    if RTNE_BF16:
        out = _rtne_bf16(w)
    else:
        out = w.to(p_ptr.dtype.element_ty)
    if MASKED:
        tl.store(w_ptr + foffs, w, mask=mask)
        tl.store(m_ptr + foffs, m, mask=mask)
        tl.store(v_ptr + foffs, v, mask=mask)
        tl.store(p_ptr + offs, out, mask=mask)
    else:
        tl.store(w_ptr + foffs, w)
        tl.store(m_ptr + foffs, m)
        tl.store(v_ptr + foffs, v)
        tl.store(p_ptr + offs, out)


@triton.jit
def adamw_multi(chunks_ptr, meta_ptr, addr_ptr, scal_ptr, scale_ptr, w_ptr, m_ptr, v_ptr, ref_ptr,
                decay, beta1, omb1, beta2, omb2, step_size, bc2_sqrt, eps,
                HAS_SCALE: tl.constexpr, PER_TENSOR: tl.constexpr,
                ALIGNED: tl.constexpr, RTNE_BF16: tl.constexpr, BLOCK: tl.constexpr,
                ITERS: tl.constexpr):
    # chunks: [C, 2] int64 (tensor, first element); meta: [T, 2] int64 (flat offset, numel);
    # addr: [T, 2] int64 (gradient address, 0 if none; parameter address);
    # scal: [T, 2] fp32 (lr / bc1, sqrt(bc2)) when PER_TENSOR; ref: any tensor of the parameters'
    # dtype, whose pointer type the addresses are cast to
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    ga = tl.load(addr_ptr + 2 * t)
    if ga != 0:
        start = tl.load(chunks_ptr + 2 * pid + 1)
        g_ptr = ga.to(ref_ptr.dtype)
        p_ptr = tl.load(addr_ptr + 2 * t + 1).to(ref_ptr.dtype)
        base = tl.load(meta_ptr + 2 * t)
        n = tl.load(meta_ptr + 2 * t + 1)
        if ALIGNED:   # every address 16-byte aligned, chunk starts and offsets multiples of 16
            g_ptr = tl.multiple_of(g_ptr, 16)
            p_ptr = tl.multiple_of(p_ptr, 16)
            start = tl.multiple_of(start, 16)
            base = tl.multiple_of(base, 16)
        if HAS_SCALE:
            scale = tl.load(scale_ptr)
        else:
            scale = 1.0
        if PER_TENSOR:
            step_size = tl.load(scal_ptr + 2 * t)
            bc2_sqrt = tl.load(scal_ptr + 2 * t + 1)
        if start + BLOCK * ITERS <= n:     # a whole chunk: no masks, vector loads
            for i in range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                _adamw_block(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, offs, base + offs, n, scale, decay, beta1,
                             omb1, beta2, omb2, step_size, bc2_sqrt, eps, False, RTNE_BF16)
        else:
            for i in range(ITERS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                _adamw_block(g_ptr, p_ptr, w_ptr, m_ptr, v_ptr, offs, base + offs, n, scale, decay, beta1,
                             omb1, beta2, omb2, step_size, bc2_sqrt, eps, True, RTNE_BF16)
'''


def adamw_kernel():
    """The jitted ``adamw_multi`` (compiled once per process: ``compile_source``)."""
    return compile_source(_SRC, "adamw_multi")


def step_scalars(hp: dict, step: int) -> Tuple[float, float]:
    """(lr / (1 - b1**step), sqrt(1 - b2**step)) for parameter group ``hp``, as torch computes
    them (double)."""
    b1, b2 = hp["betas"]
    return float(hp["lr"]) / (1 - b1 ** step), (1 - b2 ** step) ** 0.5


class AdamWLaunch:
    """The parameters of one parameter group and one dtype: one kernel launch, and the device
    tables it reads. ``members`` index the optimizer's parameters; ``numels`` and ``offsets``
    (in the flat buffers) are theirs, in that order."""

    def __init__(self, group: int, dtype: torch.dtype, members: List[int], numels: List[int],
                 offsets: List[int]):
        self.group, self.dtype, self.members = group, dtype, members
        self.numels, self.offsets = numels, offsets
        self.chunks: Optional[Tensor] = None     # device tables, built at the first kernel step
        self.meta: Optional[Tensor] = None
        self.nchunks = 0
        self.key = None                          # what the device address table holds
        self.table: Optional[Tensor] = None

    def run(self, kernel, grads: Sequence[Optional[Tensor]], params: Sequence[Tensor], steps: Sequence[int],
            hp: dict, flat: Tuple[Tensor, Tensor, Tensor], grad_scale: Optional[Tensor]) -> None:
        """One step of the members with ``kernel`` (``adamw_kernel()``): ``grads`` (None: no
        gradient), ``params`` (plain tensors, the local shards of DTensors) and ``steps`` (counts,
        already advanced) in ``members`` order; ``hp`` the group's hyperparameters; ``flat`` the
        (masters, m, v) buffers; ``grad_scale`` a 0-d fp32 tensor on the device, or None."""
        w, m, v = flat
        device = w.device
        lr, (b1, b2), eps, wd = float(hp["lr"]), hp["betas"], hp["eps"], hp["weight_decay"]
        live = [k for k, g in enumerate(grads) if g is not None]
        if not live:
            return
        if self.chunks is None:
            self.chunks, self.meta, self.nchunks = chunk_tables(self.numels, self.offsets, device)
        if self.nchunks == 0:
            return
        addrs: List[int] = []
        for g, p in zip(grads, params):
            addrs.append(g.data_ptr() if g is not None and g.numel() else 0)
            addrs.append(p.data_ptr())
        counts = {steps[k] for k in live}
        per_tensor = len(counts) > 1
        if per_tensor:
            scal = [x for g, s in zip(grads, steps) for x in (step_scalars(hp, s) if g is not None else (0.0, 1.0))]
            step_size, bc2_sqrt = 0.0, 1.0
        else:
            scal = None
            step_size, bc2_sqrt = step_scalars(hp, counts.pop())
        key = (tuple(addrs), None if scal is None else tuple(scal))
        t = len(self.members)
        if key != self.key:
            cuda = device.type == "cuda"
            host = torch.zeros(3 * t, dtype=torch.int64, pin_memory=cuda)
            host[:2 * t] = torch.tensor(addrs, dtype=torch.int64)
            if scal is not None:
                host[2 * t:].view(torch.float32).copy_(torch.tensor(scal, dtype=torch.float32))
            self.table = host.to(device, non_blocking=True) if cuda else host
            self.key = key
        block, iters, warps = config(device)
        interpret = device.type != "cuda"       # a CPU tensor runs the kernel only in the interpreter
        aligned = not any(a & 15 for a in addrs)
        kernel[(self.nchunks,)](
            self.chunks, self.meta, self.table, self.table[2 * t:].view(torch.float32),
            grad_scale if grad_scale is not None else w, w, m, v, params[0].detach(),
            1 - lr * wd, b1, 1 - b1, b2, 1 - b2, step_size, bc2_sqrt, eps,
            HAS_SCALE=grad_scale is not None, PER_TENSOR=per_tensor,
            ALIGNED=aligned, RTNE_BF16=interpret and self.dtype == torch.bfloat16,
            BLOCK=block, ITERS=iters, num_warps=warps)
