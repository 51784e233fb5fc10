"""Ops along one dim: softmax, sum/mean/amax/amin, slice/select, cat, stack."""
from __future__ import annotations

import torch

from fxmegatron.passes.tensor_parallel.nodes import norm, packet, val, where
from fxmegatron.passes.tensor_parallel.plan import SLICE, SPLIT
from fxmegatron.passes.tensor_parallel.rules.opaque import replicate_all
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.placement import Partial, R, Replicate, Shard

aten = torch.ops.aten


def _split_input(view, node):
    """(input, its split, dim count, split dim from the front, origins), or None after
    running ``node`` replicated when its input is not split."""
    x = node.args[0]
    p = view.get(x)
    if not isinstance(p, Shard):
        replicate_all(view, node, "")
        return None
    nd = val(x).ndim
    return x, p, nd, norm(p.dim, nd), view.orig(x)


@register(aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax)
def softmax(view, node):
    """Precondition: the softmax dim is not the split dim (attention scores split by
    heads); otherwise the split's matmuls are demoted."""
    s = _split_input(view, node)
    if s is None:
        return view.outcome
    x, p, nd, d, origins = s
    if norm(node.args[1], nd) == d:
        view.demote(origins, node, "takes a softmax over the split dim")
    return view.set(node, p, origins)


_MATMUL_INPUT = {aten.linear: 0, aten.mm: 0, aten.matmul: 0, aten.addmm: 1, aten.bmm: 0}
_LOOKAHEAD = 16


def _normalises_a_matmul_input(mean) -> bool:
    """Whether what ``mean`` normalises reaches a matmul as its input (through elementwise ops,
    casts and views, within _LOOKAHEAD ops): a low-rank down-projection's norm before the
    up-projection (multi-head latent attention's q and kv). There the mean keeps its input
    whole, so that the down-projection stays replicated and the up-projection column-parallel,
    as Megatron splits it, rather than row-parallel with an all-reduce of every head."""
    todo, seen = [mean], set()
    while todo and len(seen) < _LOOKAHEAD:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            pk = packet(u)
            i = _MATMUL_INPUT.get(pk)
            if i is not None:
                if len(u.args) > i and u.args[i] is n:
                    return True
                continue
            if pk is aten.scaled_dot_product_attention:
                continue
            todo.append(u)
    return False


@register(aten.sum, aten.mean, aten.amax, aten.amin)
def reduce(view, node):
    """Precondition: the split dim is not reduced (the split moves left past reduced dims
    unless keepdim), or it is a ``mean`` over it without fused blocks (a norm over all heads
    of q, as OLMo2's): each rank's mean of its equal part is a partial average,
    ``Partial("avg")``. Otherwise the split's matmuls are demoted: the reduction needs every
    rank's part, so it runs whole."""
    s = _split_input(view, node)
    if s is None:
        return view.outcome
    x, p, nd, d, origins = s
    dims = node.args[1] if len(node.args) > 1 else None
    dims = list(range(nd)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    dims = [norm(i, nd) for i in dims]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if d in dims and packet(node) is aten.mean and p.blocks is None:
        if _normalises_a_matmul_input(node):
            view.demote(origins, node, "takes a mean over the split dim of what then enters a matmul (a low-rank "
                                        "down-projection's norm): the down-projection runs whole, the matmul after "
                                        "the norm column-parallel")
        # every rank's mean is over an equal part: the whole mean is their average, made whole
        # where it is read (all-reduce, then / tp: ``rewrite``), as a norm over all heads needs
        return view.set(node, Partial("avg"), origins)
    if d in dims:
        view.demote(origins, node, "reduces over the split dim (it needs the values of every rank, e.g. a norm "
                                    "over all heads): it runs on the whole tensor")
    e = d if keep else d - sum(1 for i in dims if i < d)
    return view.set(node, Shard(e, p.blocks), origins)


@register(aten.max, aten.min)
def max_min(view, node):
    """``max(x, dim, keepdim)`` / ``min``: the values and the indices along ``dim``, each
    placed as ``reduce`` places that reduction (softmax with attention sinks subtracts the max
    over the scores and the sink); without ``dim``, a reduction of everything."""
    out = reduce(view, node)
    if isinstance(val(node), (tuple, list)) and isinstance(out.placement, Shard):
        return view.set(node, (out.placement, out.placement), out.origins)
    return out


@register(aten.slice, name="reductions.slice")
def slice_(view, node):
    """Precondition: the split dim is taken whole (slicing another dim keeps the split), or
    every ``step``-th element of it from a ``start`` below ``step`` (``gate_up[..., ::2]``,
    ``[..., 1::2]``: interleaved gate and up features, as gpt-oss's experts), with each rank's
    part a multiple of ``step`` long and no fused blocks: rank r's part of the result is then
    the same slice of its own part. Otherwise the split's matmuls are demoted."""
    s = _split_input(view, node)
    if s is None:
        return view.outcome
    x, p, nd, d, origins = s
    dim = norm(node.args[1] if len(node.args) > 1 else 0, nd)
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    step = node.args[4] if len(node.args) > 4 else 1
    to_end = len(node.args) < 4 or node.args[3] is None or node.args[3] >= val(x).shape[dim]
    if dim == d and not (to_end and start == 0 and step == 1):
        strided = (to_end and isinstance(start, int) and isinstance(step, int) and 0 <= start < step
                   and p.blocks is None and (val(x).shape[d] // view.tp) % step == 0)
        if not strided:
            view.demote(origins, node, "slices the split dim")
    return view.set(node, p, origins)


@register(aten.select)
def select(view, node):
    """Precondition: the selected dim is not the split dim; otherwise the split's matmuls
    are demoted."""
    s = _split_input(view, node)
    if s is None:
        return view.outcome
    x, p, nd, d, origins = s
    dim = norm(node.args[1], nd)
    if dim == d:
        view.demote(origins, node, "selects along the split dim")
    return view.set(node, Shard(d - (dim < d), p.blocks), origins)


def _empty_along(a, dim, nd) -> bool:
    """An input of cat that contributes nothing: empty along the cat dim (or a 1-D empty
    tensor, which cat skips)."""
    v = val(a)
    return v is not None and v.numel() == 0 and (v.ndim == 1 or (v.ndim == nd and v.shape[dim] == 0))


@register(aten.cat)
def cat(view, node):
    """Precondition: all inputs replicated, or all split along the same dim (without fused
    blocks), which is not the cat dim, beside unclaimed parameters and constants split to
    match (``_matched``). Inputs empty along the cat dim (a KV cache before
    its first token) contribute nothing: they are left out of the check, and of the cat
    when the result is split. Otherwise the splits' matmuls are demoted."""
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    nd = val(node).ndim
    dim = norm(dim, nd)
    live = [a for a in tensors if not _empty_along(a, dim, nd)] or list(tensors)
    ps = [view.get(a) for a in live]
    if all(isinstance(p, Replicate) for p in ps):
        return view.set(node, R)
    origins = set().union(*(view.orig(a) for a in live))
    splits = {(norm(p.dim, nd), p.blocks) for p in ps if isinstance(p, Shard)}
    if len(splits) == 1 and next(iter(splits))[0] != dim and next(iter(splits))[1] is None \
            and all(_matched(view, a, p, next(iter(splits))[0], node) for a, p in zip(live, ps)):
        if len(live) < len(tensors):
            view.rewrite_args((live,) + tuple(node.args[1:]))
        return view.set(node, Shard(next(iter(splits))[0]), origins)
    if origins:
        view.demote(origins, node, "concatenates differently split inputs or along the split dim")
    return replicate_all(view, node, "")


def _matched(view, a, p, d, node) -> bool:
    """Whether input ``a`` of a cat whose other inputs are split along ``d`` can be too: it is,
    or it is a parameter no rule has claimed (claimed split along ``d``: gpt-oss's attention
    sinks, one per head, beside the heads' scores), or a constant (sliced locally), or a whole
    activation (split: this rank's slice forward, the gradient all-gathered backward)."""
    if isinstance(p, Shard):
        return True
    if p is None:
        return view.claim(a, Shard(d), where(node))
    if isinstance(p, Replicate) and a not in view.needs_grad and a not in view.free:
        view.add(SLICE, a, node, d)
        return True
    if isinstance(p, Replicate) and a in view.needs_grad and a not in view.free:
        # a whole activation beside head-split ones (multi-head latent attention's shared rotary
        # key, expanded to every head, joined to the heads' own keys): this rank's slice,
        # its gradient all-gathered in the backward (split_seq)
        view.add(SPLIT, a, node, d)
        return True
    return False


@register(aten.stack)
def stack(view, node):
    """Stacks equal-shaped inputs along a new dim (the interleaved rotary's
    ``stack([-x2, x1], -1)`` on q/k split by heads). Precondition: all inputs whole, or
    all split along the same dim without fused blocks; the split then moves one dim right
    when the new dim comes before it. Partial sums are reduced first (g). Otherwise
    (inputs split along different dims, split inputs next to whole ones) the splits'
    matmuls are demoted."""
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    nd = val(node).ndim
    dim = norm(dim, nd)
    for a in tensors:
        if isinstance(view.get(a), Partial):
            view.replicate(a, node)
    ps = [view.get(a) for a in tensors]
    if all(isinstance(p, Replicate) for p in ps):
        return view.set(node, R)
    origins = set().union(*(view.orig(a) for a in tensors))
    if all(isinstance(p, Shard) for p in ps) and len({(norm(p.dim, nd - 1), p.blocks) for p in ps}) == 1 \
            and ps[0].blocks is None:
        d = norm(ps[0].dim, nd - 1)
        return view.set(node, Shard(d + 1 if d >= dim else d), origins)
    if origins:
        view.demote(origins, node, "stacks differently split inputs")
    return replicate_all(view, node, "")
