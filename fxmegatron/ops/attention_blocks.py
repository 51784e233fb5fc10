"""The math of one attention block for context parallelism: a slice of queries against a slice of
keys/values. Forward gives (out, lse); backward takes the FINAL out and lse (over every block of
those query rows), so the blocks' gradients simply add up; ``merge`` joins two partial results by
the online-softmax rule.

Shapes: q [B, H, Sq, D]; k, v [B, Hkv, Sk, D] with H % Hkv == 0 (query head h reads kv head
h // (H // Hkv), as SDPA's enable_gqa); out [B, H, Sq, D]; lse [B, H, Sq], always fp32. A causal
block is a diagonal one (Sq == Sk, top-left aligned): query row i sees key columns 0..i.

On CUDA in fp16/bf16 the fused flash kernels do the work (they return lse); elsewhere, and where
a kernel refuses, plain torch math in fp32.
"""
from __future__ import annotations

import warnings
from typing import Tuple

import torch
from torch import Tensor

_aten = torch.ops.aten
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tuple[Tensor, Tensor]:
    """(o, lse) over the union of two disjoint key sets, from each set's (o, lse); fp32. An empty
    partial is (0, -inf): it drops out exactly."""
    lse = torch.logaddexp(lse1, lse2)
    o = (o1.float() * torch.exp(lse1 - lse).unsqueeze(-1)
         + o2.float() * torch.exp(lse2 - lse).unsqueeze(-1))
    return o, lse


def block_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """(out, lse) of q against this block of k, v alone; out in fp32 or q's dtype, lse fp32."""
    if _kernel_ok(q):
        try:
            return _flash_forward(q, k, v, causal=causal, scale=scale)
        except RuntimeError as exc:     # the kernel's own checks (arch, alignment): use math
            _refused(exc)
    return _math_forward(q, k, v, causal=causal, scale=scale)


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                   causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this block, given the final ``out`` (q's dtype) and ``lse`` of these query
    rows: dS = P * (dP - rowsum(dO * O)) with P = exp(S * scale - lse). dk, dv have Hkv heads."""
    if _kernel_ok(q):
        try:
            return _flash_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        except RuntimeError as exc:
            _refused(exc)
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
# For dense (not varlen) inputs the forward returns cum_seq_* as None, and without dropout the
# philox tensors are never read: None and an empty scalar stand in for them (tried on 2.11).
def _refused(exc: RuntimeError) -> None:
    # said once per place (warnings' own dedup): the math path is correct but slow and memory-hungry
    warnings.warn(f"context-parallel attention: the flash kernel refused ({exc}); using plain math")


def _kernel_ok(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in _KERNEL_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _expand(x: Tensor, groups: int) -> Tensor:
    """kv heads repeated for the query heads that read them (the kernel has no GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _flash_forward(q, k, v, *, causal, scale):
    g = q.shape[1] // k.shape[1]
    out, lse = _aten._scaled_dot_product_flash_attention(
        q, _expand(k, g), _expand(v, g), 0.0, causal, False, scale=scale)[:2]
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, *, causal, scale):
    b, hkv, sk, d = k.shape
    g = q.shape[1] // hkv
    unused = torch.empty((), dtype=torch.long)
    # out, dout, lse arrive as row slices of the whole shard: the kernel wants them dense
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, _expand(k, g), _expand(v, g), out.contiguous(), lse.contiguous(),
        None, None, q.shape[2], sk, 0.0, causal, unused, unused, scale=scale)
    if g > 1:     # each kv head's gradient is the sum over the query heads that read it
        dk = dk.float().reshape(b, hkv, g, sk, d).sum(2)
        dv = dv.float().reshape(b, hkv, g, sk, -1).sum(2)
    return dq, dk, dv
