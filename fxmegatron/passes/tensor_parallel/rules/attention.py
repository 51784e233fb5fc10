"""Attention (scaled_dot_product_attention), split by heads; with fewer kv heads than
tp, Megatron's way: k/v computed whole on every rank, each rank using the kv heads its
own query heads need."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import arg, norm, packet, val
from fxmegatron.passes.tensor_parallel.plan import F, SLICE
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.placement import Partial, R, Replicate, Shard

aten = torch.ops.aten

# ops that only repeat or re-view their input (HF's repeat_kv: unsqueeze, expand, reshape)
_REPEAT = {aten.unsqueeze, aten.expand, aten.reshape, aten.view, aten._unsafe_view, aten.clone, aten.contiguous,
           aten.alias, aten.repeat_interleave}


def _by_heads(p) -> bool:
    return isinstance(p, Shard) and norm(p.dim, 4) == 1 and p.blocks is None


def kv_spans(n_q: int, n_kv: int, tp: int):
    """(start, length) of the kv heads rank r's query heads use, for every rank, or None
    when they do not fall evenly: rank r holds query heads [r*n_q/tp, (r+1)*n_q/tp), query
    head h uses kv head h // (n_q/n_kv) (grouped-query attention)."""
    if n_q % tp or n_q % n_kv:
        return None
    local, rep = n_q // tp, n_q // n_kv
    if local % rep and rep % local:
        return None
    return tuple((r * local // rep, max(1, local // rep)) for r in range(tp))


def _f_edge(a):
    """Where f goes for the replicated key/value ``a`` that each rank slices: on the edge
    into the repeat (unsqueeze/expand/reshape) that made ``a`` from a smaller tensor, when
    nothing else uses the repeat (the backward all-reduce is then of the kv heads only);
    None: right before the slice. (f commutes with the repeat's backward: its forward
    input is the same on every rank and a backward is linear in the gradient.)"""
    if len(a.users) != 1 or packet(a) not in _REPEAT:
        return None
    top = a
    while True:
        src = top.args[0]
        if not isinstance(src, fx.Node):
            return None
        if packet(src) in _REPEAT and len(src.users) == 1:
            top = src
            continue
        return src, top


@register(aten.scaled_dot_product_attention)
def sdpa(view, node):
    """Attention per head: precondition for a split, q split along the heads dim (1)
    without fused blocks. Each of k, v is then either split the same way, or whole: whole
    k/v (fewer kv heads than tp, HF's repeat_kv or ``enable_gqa``) are sliced on each rank
    to the kv heads its query heads use, with f on their gradient (placed before the
    repeat when there is one); precondition that those heads fall evenly (``kv_spans``).
    A mask is whole along heads (broadcast), split the same way, or a per-head constant
    (sliced locally). Otherwise: k/v split along another dim are demoted (and come back
    whole); uneven kv heads, a mask split off the heads dim or a per-head mask with
    gradients demote the splits' matmuls. All of q, k, v whole: replicated attention."""
    q, k, v = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    for a in (q, k, v):
        if isinstance(view.get(a), Partial) or view.get(a) is None:   # a partial sum, a parameter
            view.replicate(a, node)
    ps = [view.get(a) for a in (q, k, v)]
    origins = set().union(*(view.orig(a) for a in (q, k, v)))
    if all(isinstance(p, Replicate) for p in ps):
        if isinstance(mask, fx.Node):
            view.replicate(mask, node)
        return view.set(node, R)
    if not _by_heads(ps[0]):
        view.demote(origins, node, f"needs q split by heads (dim 1), got {[str(p) for p in ps]}")
    for a, p in zip((k, v), ps[1:]):
        if isinstance(p, Shard) and not _by_heads(p):
            view.demote(view.orig(a), node, f"needs its key/value {a.name} split by heads (dim 1) or whole, "
                                              f"got {p}")
    for i, (a, p) in enumerate(zip((k, v), ps[1:]), 1):
        if not isinstance(p, Replicate):
            continue
        n_q, n_kv = val(q).shape[1], val(a).shape[1]
        spans = kv_spans(n_q, n_kv, view.tp)
        if spans is None:
            view.demote(origins, node, f"has {n_q} query heads and {n_kv} kv heads: over tp={view.tp} ranks "
                                        "the kv heads each rank's query heads use are uneven")
        grad = a in view.needs_grad
        # whole as computed (not reduced or gathered for this attention): f may go before its repeat
        upstream = _f_edge(a) if grad and isinstance(view.base(a), Replicate) else None
        if upstream is not None:
            view.add(F, upstream[0], upstream[1])
        view.slice_heads(i, (1, spans, grad and upstream is None))
    if isinstance(mask, fx.Node):
        mp = view.get(mask)
        mv = val(mask)
        md = 1 - (4 - mv.ndim)
        if isinstance(mp, Shard):
            if norm(mp.dim, mv.ndim) != md:
                view.demote(origins | view.orig(mask), node, "has a mask split off the heads dim")
        elif md >= 0 and mv.shape[md] != 1:
            if mask in view.needs_grad:
                view.demote(origins, node, "has a per-head mask that needs gradients")
            view.replicate(mask, node)
            view.add(SLICE, mask, node, md)
        else:
            view.replicate(mask, node)
    return view.set(node, Shard(1), origins)


@register("fxmegatron::cp_attention")
def cp_attention(view, node):
    """Context parallelism's attention (q, k, v and flags, no mask): split by heads as ``sdpa``;
    its (out, lse) are both split alike (lse is [B, heads, S])."""
    out = sdpa(view, node)
    return view.set(node, (out.placement, out.placement), out.origins)
