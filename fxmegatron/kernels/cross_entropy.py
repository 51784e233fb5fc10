"""Fused (vocab-parallel) cross-entropy: two Triton kernels instead of fp32 copies of the logits.

The unfused form (``fxmegatron.ops.vocab_parallel``) upcasts the [N, V/t] logits to fp32
and keeps several full-size fp32 tensors for backward. Here

* forward: one pass over each row of the rank's logits, in their dtype, with an
  online max and sum of exponentials in fp32 (as flash attention does for softmax),
  and the target's logit where this rank owns it. Three vectors of N come out; the
  tp ranks combine them (max, then the rescaled sums and the target logits) with
  all-reduces of N numbers, as Megatron's vocab-parallel cross-entropy does;
* backward: (softmax − one-hot) · grad written straight into the logits' dtype,
  recomputed from the saved logits and the per-row log-sum-exp. No collective.

Only the logits (the lm_head's output, kept anyway) and two vectors of N are saved. When
nothing else reads the logits (``reuse_logits``, set by ``passes.loss_grad_in_place`` where it
proved that), the backward writes the gradient over them instead of into a new [N, V/t]
tensor, as inductor reuses a dead input's buffer: one logits-sized tensor less at the peak.
Where that mutating call cannot be compiled (inside the ``control_deps`` subgraphs of inductor's
overlap scheduler, ``lower/overlap_scheduler.py``), ``grad_in_graph`` states the same backward as
torch ops instead (``_grad_ops``): inductor fuses them into one kernel and, the logits being a
donated buffer of the backward, may write it over them itself. Under compile only: eagerly those
ops would make fp32 copies of the logits.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from fxmegatron.codegen.kernel_cache import compile_source

_SRC = '''
@triton.jit
def ce_fwd(x_ptr, t_ptr, max_ptr, sum_ptr, pick_ptr, V, stride, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    t = tl.load(t_ptr + row)
    m = -float("inf")
    s = 0.0
    for start in range(0, V, BV):
        cols = start + tl.arange(0, BV)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    inside = (t >= 0) & (t < V)
    pick = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(pick_ptr + row, tl.where(inside, pick, 0.0))


@triton.jit
def ce_bwd(x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, V, stride, dx_stride, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    mask = cols < V
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    t = tl.load(t_ptr + row)
    d = (tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)) * g
    tl.store(dx_ptr + row * dx_stride + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)
'''

_BV_FWD, _BV_BWD = 2048, 1024


def _kernels():
    return compile_source(_SRC, "ce_fwd"), compile_source(_SRC, "ce_bwd")


# torch.library ops, so that torch.compile keeps them as calls (inductor would otherwise
# trace the unfused fp32 form); ``group_name`` as in ``fxmegatron.ops.collectives``
@torch.library.custom_op("fxmegatron::vocab_ce", mutates_args=())
def vocab_ce(logits: Tensor, local_target: Tensor, valid: Tensor, group_name: str,
             reuse_logits: bool = False, grad_in_graph: bool = False) -> Tuple[Tensor, Tensor]:
    """(per-row losses, per-row log-sum-exp) of [N, V/t] logits split along the vocabulary."""
    from fxmegatron.ops.groups import communicator
    fwd, _ = _kernels()
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, v = x.shape
    t = local_target.contiguous()
    mx = torch.empty(n, dtype=torch.float32, device=x.device)
    sm, pick = torch.empty_like(mx), torch.empty_like(mx)
    fwd[(n,)](x, t, mx, sm, pick, v, x.stride(0), BV=_BV_FWD)
    comm = communicator(group_name)
    if comm is not None:
        gmax = comm.all_reduce(mx, "max")
        sm = sm * torch.exp(mx - gmax)
        both = comm.all_reduce(torch.stack([sm, pick]), "sum")
        sm, pick, mx = both[0], both[1], gmax
    lse = torch.log(sm) + mx
    return (lse - pick).masked_fill(~valid, 0.0), lse


@vocab_ce.register_fake
def _(logits, local_target, valid, group_name, reuse_logits=False, grad_in_graph=False):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("fxmegatron::vocab_ce_backward", mutates_args=())
def vocab_ce_backward(logits: Tensor, local_target: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """(softmax − one-hot) · g per row, in the logits' dtype; g is 0 on ignored rows."""
    _, bwd = _kernels()
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    n, v = x.shape
    # Triton's interpreter truncates fp32 -> bf16/fp16 where GPUs round to nearest even (as
    # torch's cast does): there, write fp32 and let torch round
    narrow_on_host = not x.is_cuda and x.dtype != torch.float32
    dx = torch.empty((n, v), dtype=torch.float32 if narrow_on_host else x.dtype, device=x.device)
    bwd[(n, (v + _BV_BWD - 1) // _BV_BWD)](x, local_target.contiguous(), lse, g.contiguous(), dx, v,
                                            x.stride(0), dx.stride(0), BV=_BV_BWD)
    return dx.to(x.dtype) if narrow_on_host else dx


@vocab_ce_backward.register_fake
def _(logits, local_target, lse, g):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("fxmegatron::vocab_ce_backward_", mutates_args=("logits",))
def vocab_ce_backward_(logits: Tensor, local_target: Tensor, lse: Tensor, g: Tensor) -> None:
    """``vocab_ce_backward`` written over ``logits``: each element is read, then written, by the
    same program. Rows may be further apart than V (under ``compile=True`` inductor pads the
    row stride of a logits buffer whose V is not a multiple of its alignment, GPT-2's 50257):
    the kernel writes each row at its own stride, as it reads it."""
    _, bwd = _kernels()
    n, v = logits.shape
    if logits.stride(-1) != 1 or (not logits.is_cuda and logits.dtype != torch.float32):
        # columns not adjacent, or the interpreter's rounding (as above): out of place, copied back
        logits.copy_(vocab_ce_backward(logits, local_target, lse, g))
        return
    bwd[(n, (v + _BV_BWD - 1) // _BV_BWD)](logits, local_target.contiguous(), lse, g.contiguous(), logits, v,
                                            logits.stride(0), logits.stride(0), BV=_BV_BWD)


def _grad_ops(logits: Tensor, local_target: Tensor, lse: Tensor, g: Tensor) -> Tensor:
    """``vocab_ce_backward`` as torch ops (the kernel's formula), for inductor to fuse."""
    cols = torch.arange(logits.shape[-1], device=logits.device)
    one_hot = (cols == local_target.unsqueeze(-1)).to(torch.float32)
    return ((torch.exp(logits.float() - lse.unsqueeze(-1)) - one_hot) * g.unsqueeze(-1)).to(logits.dtype)


def _setup(ctx, inputs, output):
    logits, local_target, valid, _, reuse, in_graph = inputs
    ctx.in_graph = in_graph
    ctx.reuse = reuse and logits.stride(-1) == 1 and logits.is_contiguous()
    ctx.save_for_backward(logits, local_target, output[1], valid)


def _backward(ctx, g, _g_lse):
    logits, local_target, lse, valid = ctx.saved_tensors
    g = g.float() * valid            # ignored tokens: no gradient
    none = (None,) * 5
    if ctx.in_graph:
        return (_grad_ops(logits, local_target, lse, g),) + none
    if ctx.reuse:
        vocab_ce_backward_(logits, local_target, lse, g)
        return (logits,) + none
    return (vocab_ce_backward(logits, local_target, lse, g),) + none


vocab_ce.register_autograd(_backward, setup_context=_setup)


def fused_vocab_cross_entropy(logits: Tensor, target: Tensor, vocab_start: int, group_name: str,
                              ignore_index: int = -100, reuse_logits: bool = False,
                              grad_in_graph: bool = False) -> Tensor:
    """Per-token losses (0 where ``target == ignore_index``), fp32; see the module doc."""
    local = target - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    valid = target != ignore_index
    # -1: not this rank's class (or ignored); the kernels then pick nothing and subtract no one-hot
    local = torch.where(inside & valid, local, torch.full_like(local, -1))
    v = logits.shape[-1]
    loss, _ = vocab_ce(logits.reshape(-1, v), local.reshape(-1), valid.reshape(-1), group_name, reuse_logits,
                       grad_in_graph)
    return loss.reshape(logits.shape[:-1])
