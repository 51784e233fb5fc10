"""The math of one attention block for context parallelism: a slice of queries against a slice of
keys/values. Forward gives (out, lse); backward takes the FINAL out and lse (over every block of
those query rows), so the blocks' gradients simply add up; ``merge`` joins two partial results by
the online-softmax rule.

Shapes: q [B, H, Sq, D]; k, v [B, Hkv, Sk, D] with H % Hkv == 0 (query head h reads kv head
h // (H // Hkv), as SDPA's enable_gqa); out [B, H, Sq, D]; lse [B, H, Sq], always fp32. A causal
block is a diagonal one (Sq == Sk, top-left aligned): query row i sees key columns 0..i.

On CUDA in fp16/bf16 a fused kernel does the work (cuDNN's, else flash's; both return lse);
elsewhere, and where every kernel refuses, plain torch math in fp32.
"""
from __future__ import annotations

import os
import warnings
from typing import Tuple

import torch
from torch import Tensor

from fxmegatron.ops.own_thread import on_own_thread

_aten = torch.ops.aten
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tuple[Tensor, Tensor]:
    """(o, lse) over the union of two disjoint key sets, from each set's (o, lse); fp32. An empty
    partial is (0, -inf): it drops out exactly."""
    lse = torch.logaddexp(lse1, lse2)
    o = (o1.float() * torch.exp(lse1 - lse).unsqueeze(-1)
         + o2.float() * torch.exp(lse2 - lse).unsqueeze(-1))
    return o, lse


def merge_(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
    """``merge`` written into ``out`` (fp32) and ``lse`` in place: views of the accumulators of a
    rank's rows, so no new [B, H, S, D] buffer per block."""
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).addcmul_(o.float(), torch.exp(l - new).unsqueeze(-1))
    lse.copy_(new)


def in_q_order(shape, q: Tensor, dtype: torch.dtype) -> Tensor:
    """An empty tensor of ``shape`` laid out densely in q's order of dimensions (``dense_strides``):
    how the fused kernels lay out their outputs, and so fxmegatron's attention ops theirs; the
    ops' fake implementations say the same (``tests/test_op_fakes.py``)."""
    return torch.empty_strided(tuple(shape), dense_strides(shape, q), dtype=dtype, device=q.device)


class BlockSums:
    """An fp32 accumulator of row chunks: a chunk's first contribution is copied in, later ones
    added, and the chunks nobody wrote are zeroed when the sum is read (``whole``), so the
    common case (every chunk written) never fills zeros nor reads them back. ``where(r, ch)``:
    the index of rank r's chunk ch in ``t``."""

    def __init__(self, t: Tensor, where, whole: bool = False):
        self.t, self.where, self.written, self.all = t, where, set(), whole

    def add(self, r: int, chunks, parts) -> None:
        """Add each (index, value) of ``parts`` to ``t``; together they cover rank r's ``chunks``."""
        keys = {(r, ch) for ch in chunks}
        if keys & self.written and not keys <= self.written:
            raise RuntimeError(f"context-parallel plan: a block covers chunks {chunks} of rank {r}, partly "
                               "summed before")
        first = not self.all and not keys <= self.written
        for at, x in parts:
            if first:
                self.t[at].copy_(x)
            else:
                self.t[at].add_(x)
        self.written |= keys

    def complete(self, keys) -> bool:
        """Whether every (rank, chunk) of ``keys`` got a contribution."""
        return self.all or all(k in self.written for k in keys)

    def whole(self, keys) -> Tensor:
        """The sum, with every (rank, chunk) of ``keys`` that got no contribution set to zero."""
        if not self.all:
            for r, ch in keys:
                if (r, ch) not in self.written:
                    self.t[self.where(r, ch)].zero_()
        return self.t


def block_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """(out, lse) of q against this block of k, v alone; out in fp32 or q's dtype, lse fp32."""
    if _kernel_ok(q):
        for name in kernels():
            try:
                return _FORWARD[name](q, k, v, causal=causal, scale=scale)
            except _REFUSALS as exc:     # the kernel's own checks (arch, alignment, cuDNN version)
                _refused(name, exc)
    return _math_forward(q, k, v, causal=causal, scale=scale)


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                   causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this block, given the final ``out`` (q's dtype) and ``lse`` of these query
    rows: dS = P * (dP - rowsum(dO * O)) with P = exp(S * scale - lse). dk, dv have Hkv heads.
    Any kernel's backward may follow any kernel's forward: the lse is the same quantity."""
    if _kernel_ok(q):
        for name in kernels():
            try:
                return _BACKWARD[name](dout, q, k, v, out, lse, causal=causal, scale=scale)
            except _REFUSALS as exc:
                _refused(name, exc)
    return _math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


# ---- plain math (fp32) ------------------------------------------------------------------------
def _grouped(x: Tensor, hkv: int) -> Tensor:
    """[B, H, S, D] -> [B, Hkv, G, S, D] in fp32: the G query heads that share a kv head."""
    b, h, s, d = x.shape
    return x.float().reshape(b, hkv, h // hkv, s, d)


def _scores(qg: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """[B, Hkv, G, Sq, Sk] scaled scores, -inf above the diagonal of a causal block."""
    s = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _math_forward(q, k, v, *, causal, scale):
    b, h, sq, d = q.shape
    s = _scores(_grouped(q, k.shape[1]), k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                                        # [B, Hkv, G, Sq]
    o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float().unsqueeze(2))
    return o.reshape(b, h, sq, d), lse.reshape(b, h, sq)


def _math_backward(dout, q, k, v, out, lse, *, causal, scale):
    b, h, sq, d = q.shape
    hkv = k.shape[1]
    qg, do = _grouped(q, hkv), _grouped(dout, hkv)
    p = torch.exp(_scores(qg, k, causal, scale) - lse.float().reshape(b, hkv, h // hkv, sq, 1))
    delta = (do * _grouped(out, hkv)).sum(-1, keepdim=True)                # rowsum(dO * O)
    ds = p * (torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.float().unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale             # summed over the group
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    return dq.reshape(b, h, sq, d), dk, dv


# ---- fused kernels (CUDA, fp16/bf16) ----------------------------------------------------------
# Signatures checked in torch 2.11 (the GPU machines) and 2.13 (here), identical:
#   _scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, return_debug_mask,
#       *, scale) -> (output, logsumexp [B, H, Sq] fp32, cum_seq_q, cum_seq_k, max_q, max_k,
#       rng_state, unused, debug_attn_mask)
#   _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp,
#       cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
#       *, scale) -> (grad_query, grad_key, grad_value)
#   _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp,
#       dropout_p, is_causal, return_debug_mask, *, scale) -> (output, logsumexp [B, H, Sq, 1]
#       fp32 (or [B, H, Sq]), cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, ...)
#   _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp,
#       philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
#       is_causal, *, scale) -> (grad_query, grad_key, grad_value)
# For dense (not varlen) inputs cum_seq_* are unused, and without dropout the philox tensors are
# never read: empty tensors stand in for them. Grouped kv heads go in as they are (both kernels
# take H % Hkv == 0); where a kernel refuses that, they are repeated and the gradients summed.
KERNELS = ("cudnn", "flash")
# what a kernel's own argument checks raise (torch's TORCH_CHECK: RuntimeError; index checks)
_REFUSALS = (RuntimeError, IndexError, ValueError)
DEFAULT_KERNELS = "cudnn,flash"


def kernels() -> Tuple[str, ...]:
    """The fused kernels tried in order, from FXMEGATRON_CP_KERNELS (a comma list of KERNELS;
    default DEFAULT_KERNELS): read at each call, so a benchmark can compare them."""
    raw = os.environ.get("FXMEGATRON_CP_KERNELS", "").strip() or DEFAULT_KERNELS
    names = tuple(n.strip() for n in raw.split(",") if n.strip())
    bad = [n for n in names if n not in KERNELS]
    if bad:
        raise ValueError(f"FXMEGATRON_CP_KERNELS={raw!r}: {bad} not among {KERNELS}")
    return names


def _refused(name: str, exc: Exception) -> None:
    # said once per place (warnings' own dedup): the next kernel, or the math path, is correct
    warnings.warn(f"fxmegatron attention: the {name} kernel refused ({str(exc).splitlines()[0]}); "
                  "trying the next (the last resort is plain math: correct, slow, memory-hungry)")


def kernels_take(t: Tensor) -> bool:
    """Whether the fused kernels take a q, k or v of this dtype and head dim (wherever it is)."""
    return t.dtype in _KERNEL_DTYPES and t.shape[-1] % 8 == 0 and t.shape[-1] <= 256


def _kernel_ok(q: Tensor) -> bool:
    return q.is_cuda and kernels_take(q)


def _expand(x: Tensor, groups: int) -> Tensor:
    """kv heads repeated for the query heads that read them."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _grouped_call(fn, q: Tensor, k: Tensor, v: Tensor):
    """fn(q, k, v) with the kv heads as they are; repeated if the kernel refuses them."""
    g = q.shape[1] // k.shape[1]
    if g == 1:
        return fn(q, k, v)
    try:
        return fn(q, k, v)
    except _REFUSALS:
        return fn(q, _expand(k, g), _expand(v, g))


def _fold_heads(dk: Tensor, dv: Tensor, hkv: int) -> Tuple[Tensor, Tensor]:
    """Each kv head's gradient, where the kernel gave one per query head: their sum."""
    if dk.shape[1] == hkv:
        return dk, dv
    b, h, sk, d = dk.shape
    return (dk.float().reshape(b, hkv, h // hkv, sk, d).sum(2),
            dv.float().reshape(b, hkv, h // hkv, sk, dv.shape[-1]).sum(2))


def _flash_forward(q, k, v, *, causal, scale):
    out, lse = _grouped_call(lambda q_, k_, v_: _aten._scaled_dot_product_flash_attention(
        q_, k_, v_, 0.0, causal, False, scale=scale)[:2], q, k, v)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    unused = torch.empty((), dtype=torch.long)
    # out, dout, lse arrive as row slices of the whole shard: the kernel wants them dense
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    dq, dk, dv = _grouped_call(lambda q_, k_, v_: _aten._scaled_dot_product_flash_attention_backward(
        dout, q_, k_, v_, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, unused, unused,
        scale=scale), q, k, v)
    return (dq,) + _fold_heads(dk, dv, k.shape[1])


def _cudnn_forward(q, k, v, *, causal, scale):
    out, lse = _grouped_call(lambda q_, k_, v_: _aten._scaled_dot_product_cudnn_attention(
        q_, k_, v_, None, True, 0.0, causal, False, scale=scale)[:2], q, k, v)
    return out, lse.reshape(q.shape[:3])


def dense_strides(shape, q: Tensor) -> list:
    """The strides of a dense tensor of ``shape`` in q's order of dimensions: how cuDNN's forward
    lays out its output."""
    order = sorted(range(q.dim()), key=lambda d: q.stride(d))     # innermost first, stable as torch's
    strides, step = [0] * q.dim(), 1
    for d in order:
        strides[d], step = step, step * shape[d]
    return strides


def like_q(t: Tensor, q: Tensor) -> Tensor:
    """``t`` (q's shape but its last dim) dense in q's order of dimensions (``dense_strides``):
    unchanged when it already is, else copied."""
    strides = dense_strides(t.shape, q)
    if tuple(t.stride()) == tuple(strides):
        return t
    if all(t.stride(d) == strides[d] for d in range(t.dim()) if t.shape[d] > 1):    # size-1 dims' alone
        return t.as_strided(t.shape, strides, t.storage_offset())
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _cudnn_backward(dout, q, k, v, out, lse, *, causal, scale):
    # The backward graph bakes in the strides of dO and O, which torch's graph cache does not key
    # on: both go in one layout, the one the forward gives O (a function of q's strides, which
    # the cache keys on), and the call runs on fxmegatron's own thread, whose cache no other
    # caller fills (ops/own_thread.py). Statistics as [B, H, Sq, 1]; no bias and no ragged
    # offsets: undefined tensors (None), as autograd passes them.
    out = like_q(out, q)
    dout, lse = like_q(dout, q), lse.contiguous().unsqueeze(-1)
    seed = torch.empty((), dtype=torch.long, device=q.device)
    call = lambda q_, k_, v_: _aten._scaled_dot_product_cudnn_attention_backward(      # noqa: E731
        dout, q_, k_, v_, out, lse, seed, seed, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)
    dq, dk, dv = on_own_thread(lambda: _grouped_call(call, q, k, v), q.device)
    return (dq,) + _fold_heads(dk, dv, k.shape[1])


_FORWARD = {"flash": _flash_forward, "cudnn": _cudnn_forward}
_BACKWARD = {"flash": _flash_backward, "cudnn": _cudnn_backward}
