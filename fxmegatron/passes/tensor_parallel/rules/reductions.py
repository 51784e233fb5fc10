"""Ops along one dim: softmax, sum/mean/amax/amin, slice/select, cat, stack."""
from __future__ import annotations

import torch

from fxmegatron.passes.tensor_parallel.nodes import norm, val
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


@register(aten.sum, aten.mean, aten.amax, aten.amin)
def reduce(view, node):
    """Precondition: the split dim is not reduced (the split moves left past reduced dims
    unless keepdim); otherwise the split's matmuls are demoted: the reduction needs every
    rank's part (a norm over all heads of q, as OLMo2's, needs all of them), so it runs
    whole."""
    s = _split_input(view, node)
    if s is None:
        return view.outcome
    x, p, nd, d, origins = s
    dims = node.args[1] if len(node.args) > 1 else None
    dims = list(range(nd)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    dims = [norm(i, nd) for i in dims]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if d in dims:
        view.demote(origins, node, "reduces over the split dim (it needs the values of every rank, e.g. a norm "
                                    "over all heads): it runs on the whole tensor")
    e = d if keep else d - sum(1 for i in dims if i < d)
    return view.set(node, Shard(e, p.blocks), origins)


@register(aten.slice, name="reductions.slice")
def slice_(view, node):
    """Precondition: the split dim is taken whole (slicing another dim keeps the split);
    otherwise the split's matmuls are demoted."""
    s = _split_input(view, node)
    if s is None:
        return view.outcome
    x, p, nd, d, origins = s
    dim = norm(node.args[1] if len(node.args) > 1 else 0, nd)
    full = (len(node.args) < 3 or node.args[2] in (0, None)) and (
        len(node.args) < 4 or node.args[3] is None or node.args[3] >= val(x).shape[dim])
    if dim == d and not full:
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
    blocks), which is not the cat dim. Inputs empty along the cat dim (a KV cache before
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
    if all(isinstance(p, Shard) for p in ps) and len({(norm(p.dim, nd), p.blocks) for p in ps}) == 1 \
            and norm(ps[0].dim, nd) != dim and ps[0].blocks is None:
        if len(live) < len(tensors):
            view.rewrite_args((live,) + tuple(node.args[1:]))
        return view.set(node, ps[0], origins)
    if origins:
        view.demote(origins, node, "concatenates differently split inputs or along the split dim")
    return replicate_all(view, node, "")


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
