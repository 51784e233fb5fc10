"""Context-parallel attention against full SDPA: every rank builds the same random q, k, v, dout
of the whole sequence (shared seed), takes its load-balanced rows, runs ``cp_attention`` forward
and backward, and reports its largest errors against full SDPA's output and gradients at those
rows. Used by the gloo / NCCL workers here and by the ranks-as-threads tests."""
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from fxmegatron.ops.context_attention import (
    attention_plan, cp_attention, load_balanced_index, run_backward, run_forward)


class Case(NamedTuple):
    variant: str
    is_causal: bool
    heads: int
    kv_heads: int
    seq: int
    scale: Optional[float] = None
    batch: int = 2
    head_dim: int = 8
    seed: int = 0

    def label(self) -> str:
        mask = "causal" if self.is_causal else "full"
        return f"{self.variant}-{mask}-h{self.heads}kv{self.kv_heads}-s{self.seq}-scale{self.scale}"


def grid(seq, variants=("ring", "allgather")):
    """Both variants, causal and not, GQA (H=4, Hkv=2) and not (H=Hkv=2), and a custom scale."""
    cases = [Case(v, c, h, kv, seq) for v in variants for c in (True, False) for h, kv in ((4, 2), (2, 2))]
    return cases + [Case(v, True, 4, 1, seq, scale=0.3) for v in variants]


def inputs(case: Case, device="cpu", dtype=torch.float32):
    """q, k, v, dout of the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(case.seed)
    b, s, d = case.batch, case.seq, case.head_dim

    def randn(heads):
        return torch.randn(b, heads, s, d, generator=g).to(device=device, dtype=dtype)
    return randn(case.heads), randn(case.kv_heads), randn(case.kv_heads), randn(case.heads)


def reference(case: Case, device="cpu", dtype=torch.float32):
    """Full SDPA in fp32 on the (possibly rounded) inputs: out, dq, dk, dv."""
    q, k, v, dout = (x.float().requires_grad_() for x in inputs(case, device, dtype))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, enable_gqa=True)
    out.backward(dout.detach())
    return out.detach(), q.grad, k.grad, v.grad


def shard_errors(case: Case, group, cp: int, rank: int, device="cpu", dtype=torch.float32, autograd=True):
    """{name: (max |error|, max |reference|)} of this rank's out, dq, dk, dv. Not ``autograd``:
    the plan walked by hand, for ranks that are threads of one process on a GPU (autograd runs
    every CUDA backward on one engine thread, where the ranks would wait for each other)."""
    idx = load_balanced_index(case.seq, cp, rank).to(device)
    q, k, v, dout = (x[:, :, idx].clone() for x in inputs(case, device, dtype))
    if autograd:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = cp_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, group=group, cp=cp,
                           rank=rank, variant=case.variant)
        out.backward(dout)
        got = (out.detach(), q.grad, k.grad, v.grad)
    else:
        plan = attention_plan(cp, rank, case.is_causal, case.variant)
        scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.head_dim)
        out, lse = run_forward(plan, q, k, v, scale=scale, transport=group)
        got = (out,) + run_backward(plan, dout, q, k, v, out, lse, scale=scale, transport=group)
    errs = {}
    for name, a, ref in zip(("out", "dq", "dk", "dv"), got, reference(case, device, dtype)):
        ref = ref[:, :, idx]
        assert a.dtype == dtype and a.shape == ref.shape, (name, a.dtype, a.shape, ref.shape)
        errs[name] = ((a.float() - ref).abs().max().item(), ref.abs().max().item())
    return errs


def cp_cases(rank, world, cases, subgroups=(), sub_cases=()):
    """On one process of ``world``: ``cases`` with cp = world over the whole world, then
    ``sub_cases`` in the group of ``subgroups`` (lists of global ranks) holding this rank, where
    group rank and global rank differ. {(label, "world" | "sub"): errors}."""
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    device, dtype = ("cuda", torch.bfloat16) if nccl else ("cpu", torch.float32)
    out = {}
    for case in cases:
        out[(case.label(), "world")] = shard_errors(case, dist.group.WORLD, world, rank, device, dtype)
    groups = [(ranks, dist.new_group(ranks)) for ranks in subgroups]    # every rank makes every group
    for ranks, group in groups:
        if rank in ranks:
            for case in sub_cases:
                out[(case.label(), "sub")] = shard_errors(case, group, len(ranks), ranks.index(rank),
                                                          device, dtype)
    return out
