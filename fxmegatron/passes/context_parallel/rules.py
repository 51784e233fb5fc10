"""Context-parallel rules: ATen op -> how it runs on this rank's chunks of the sequence.

Each rule is a pure function ``rule(view, node, split) -> Outcome`` (``registry``): it reads
placements and returns the node's placement and the changes it needs at its inputs (takes,
sums); the walk records them. ``split``: some input holds chunks (or a whole sequence input
was just taken for it); the rule then places the output or refuses with the reason, naming
the node. Without a split input the op runs whole, as in the original
model, and the rule only tracks where the sequence went (``Replicate(seq=...)``), or
forgets it (``R``), never refusing. Placements are ``fxmegatron.placement``'s on the cp axis
(``layout``: a sequence shard is ``Shard(d, seq_inner=i)``). A partial sum (a loss over this rank's tokens)
stays partial through linear ops, and is summed over cp (``cp_sum``) before anything else.

Stated preconditions, per family:
* elementwise: every split input's sequence lands on the same output dim; whole inputs
  have, at that dim, size 1 or the whole sequence (then taken);
* views: the sequence stays one contiguous [outer, S, inner] run of one dim (``layout``);
  slicing, selecting or padding along it is refused;
* matmuls and embeddings: the sequence is a batch dim, never contracted;
* norms, softmax and reductions: not over the sequence, except a sum or mean over it,
  which becomes a partial sum;
* top-k: not along the sequence;
* a mixture-of-experts block (``experts``): its tokens, expert ids and routing weights are
  this rank's chunks alike; its ops run on this rank's tokens;
* cross-entropy: 2-D logits [N, V], N the flattened sequence; mean over counted tokens
  becomes a sum over this rank's tokens divided by the count over all cp ranks;
* attention (SDPA): q, k and v split along the sequence (dim -2), no mask (causal or
  not), no dropout: it becomes ``cp_attention``.
"""
from __future__ import annotations

import operator

import torch

from fxmegatron.passes.context_parallel.layout import is_split, seq_at, seq_of, seq_through_view
from fxmegatron.passes.context_parallel.registry import (Outcome, aligned_take, no_rule, register, summed,
                                                         tensor_inputs)
from fxmegatron.passes.tensor_parallel.nodes import arg, norm, packet, val
from fxmegatron.placement import P, R

aten = torch.ops.aten


# ---- elementwise -------------------------------------------------------------------
_LINEAR_UNARY = {aten.neg, aten.alias, aten.clone, aten.contiguous, aten.to, aten._to_copy, aten.view,
                 aten.reshape, aten._unsafe_view, aten.squeeze, aten.unsqueeze, aten.type_as}


def _partial(view, node) -> bool:
    """Whether ``node`` keeps a partial sum partial: a copy, a negation, a scaling by a
    whole value, a sum of partial values."""
    pk, ins = packet(node), tensor_inputs(node)
    parts = [a for a in ins if view.get(a) == P]
    if not parts:
        return False
    if pk in _LINEAR_UNARY:
        return node.args[0] in parts and len(parts) == 1
    if pk is aten.mul:
        return len(parts) == 1 and all(view.get(a) == R for a in ins if a not in parts)
    if pk is aten.div:
        return parts == [node.args[0]] and all(view.get(a) == R for a in ins if a is not node.args[0])
    if pk in (aten.add, aten.sub):
        return len(parts) == len(ins) == 2 and len(node.args) < 3 and not node.kwargs
    return False


@register("pointwise", aten.dropout, aten.type_as, aten.masked_fill, aten.where, aten.alias, aten.clone, aten.contiguous,
          aten.detach, aten.lift_fresh_copy, aten.gelu, aten.silu, aten.to, aten._to_copy)
def elementwise(view, node, split):
    """Output's sequence where every sequence input's lands (right-aligned broadcasting)."""
    out = val(node)
    if _partial(view, node):
        return Outcome(P, "elementwise.partial")
    if not isinstance(out, torch.Tensor):
        return no_rule(view, node, split)
    if packet(node) is aten.dropout and split and node.args[1] > 0 and node.args[2]:
        view.fail(node, f"is dropout (p={node.args[1]}): counter-based dropout does not yet know the "
                        "global positions of this rank's two chunks")
    seqs = {}
    for a in tensor_inputs(node):
        p = view.placed(a)
        if seq_of(p) is not None and (is_split(p) or not split):
            seqs[a] = seq_at(p, seq_of(p)[0] + out.ndim - val(a).ndim)
    if len(set(seqs.values())) > 1:
        if split:
            view.fail(node, "combines tensors whose sequences lie on different dims "
                            f"({', '.join(f'{a.name}: {s}' for a, s in seqs.items())})")
        return summed(view, node, R, "elementwise")
    if not seqs:
        return summed(view, node, R, "elementwise")
    s = next(iter(seqs.values()))
    takes = []
    if split:
        for a in tensor_inputs(node):
            if a not in seqs:
                takes.extend(aligned_take(view, a, node, s, out))
    return summed(view, node, s, "elementwise", takes)


# ---- views ---------------------------------------------------------------------------
def _seq_of(view, node):
    """The placement of ``node.args[0]``, or None when it holds no sequence."""
    p = view.placed(node.args[0])
    return p if seq_of(p) is not None else None


def _view_result(view, node, split, s, why, note=None):
    if s is None:
        if split:
            view.fail(node, why)
        return summed(view, node, R, "views")
    return summed(view, node, s, "views", note=note)


_SIZED = (aten.view, aten.reshape, aten._unsafe_view, aten.expand)     # take the output sizes as arg 1


@register(aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.flatten)
def reshape(view, node, split):
    if _partial(view, node):
        return Outcome(P, "views.partial")
    s = _seq_of(view, node)
    if s is None:
        return summed(view, node, R, "views")
    x = val(node.args[0])
    if packet(node) is aten.expand:
        lead = val(node).ndim - x.ndim
        r = seq_at(s, seq_of(s)[0] + lead)
    else:
        r = seq_through_view(tuple(x.shape), s, tuple(val(node).shape), view.seq)
    note = ("size", (1, seq_of(r)[0])) if r is not None and is_split(r) and packet(node) in _SIZED else None
    return _view_result(view, node, split, r, f"reshapes {tuple(x.shape)} to {tuple(val(node).shape)}, which "
                                              f"cuts the sequence ({s}) apart", note)


@register(aten.permute, aten.transpose, aten.t, aten.unsqueeze, aten.squeeze)
def move_dims(view, node, split):
    """A partial input stays partial where the op is linear (``_partial``), else it is summed."""
    if _partial(view, node):
        return Outcome(P, "views.partial")
    s = _seq_of(view, node)
    if s is None:
        return summed(view, node, R, "views")
    nd, pk = val(node.args[0]).ndim, packet(node)
    sd = seq_of(s)[0]
    if pk is aten.permute:
        perm = [norm(d, nd) for d in node.args[1]]
        r = seq_at(s, perm.index(sd))
    elif pk in (aten.transpose, aten.t):
        a, b = (norm(node.args[1], nd), norm(node.args[2], nd)) if pk is aten.transpose else (0, 1)
        r = seq_at(s, b if sd == a else a if sd == b else sd)
    elif pk is aten.unsqueeze:
        d = norm(node.args[1], nd + 1)
        r = seq_at(s, sd + (1 if d <= sd else 0))
    else:
        dims = node.args[1] if len(node.args) > 1 else [i for i in range(nd) if val(node.args[0]).shape[i] == 1]
        dims = [norm(d, nd) for d in ([dims] if isinstance(dims, int) else dims)]
        dims = [d for d in dims if val(node.args[0]).shape[d] == 1]
        r = seq_at(s, sd - sum(1 for d in dims if d < sd))
    return summed(view, node, r, "views")


@register(aten.slice, aten.select, aten.narrow)
def index_dim(view, node, split):
    s = _seq_of(view, node)
    if s is None:
        return summed(view, node, R, "views")
    nd = val(node.args[0]).ndim
    d = norm(arg(node, 1, "dim", 0), nd)
    sd = seq_of(s)[0]
    if d == sd:
        x, y = val(node.args[0]), val(node)
        if tuple(x.shape) == tuple(y.shape):      # a slice of everything
            return summed(view, node, s, "views")
        return _view_result(view, node, split, None, f"slices or selects along the sequence ({s})")
    r = seq_at(s, sd - 1) if packet(node) is aten.select and d < sd else s
    return summed(view, node, r, "views")


@register(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind)
def pieces(view, node, split):
    """Pieces along another dim than the sequence (a fused qkv projection's split)."""
    s = _seq_of(view, node)
    n = len(val(node))
    if s is None:
        return summed(view, node, (R,) * n, "views.pieces")
    nd = val(node.args[0]).ndim
    d = norm(arg(node, 1 if packet(node) is aten.unbind else 2, "dim", 0), nd)
    sd = seq_of(s)[0]
    if d == sd:
        if split:
            view.fail(node, f"cuts the sequence ({s}) into pieces")
        return summed(view, node, (R,) * n, "views.pieces")
    r = seq_at(s, sd - 1) if packet(node) is aten.unbind and d < sd else s
    return summed(view, node, (r,) * n, "views.pieces")


@register(aten.stack)
def stack(view, node, split):
    """Tensors split alike, stacked along a new dim (interleaved rotary: GPT-J, Cohere)."""
    parts = node.args[0]
    ps = [view.placed(a) for a in parts]
    nd = val(node).ndim
    d = norm(arg(node, 1, "dim", 0), nd)
    if len(set(ps)) == 1 and seq_of(ps[0]) is not None:
        s, sd = ps[0], seq_of(ps[0])[0]
        return summed(view, node, seq_at(s, sd + (1 if d <= sd else 0)), "views.stack")
    if split:
        view.fail(node, f"stacks {[str(p) for p in ps]}: only tensors split alike")
    return summed(view, node, R, "views.stack")


@register(aten.index)
def index(view, node, split):
    """x[..., idx, ...] with one whole index tensor at another dim than the sequence (Falcon's
    per-head k/v selection); the dim keeps its place."""
    s = _seq_of(view, node)
    if s is None:
        return no_rule(view, node, split)
    idx = [(i, t) for i, t in enumerate(node.args[1]) if t is not None]
    ok = (len(idx) == 1 and idx[0][0] != seq_of(s)[0] and isinstance(idx[0][1], torch.fx.Node)
          and not view.split(idx[0][1]) and val(idx[0][1]).ndim == 1)
    if not ok:
        return _view_result(view, node, split, None, f"indexes {s} with {node.args[1]}: only one whole 1-D index "
                                                     "at another dim than the sequence")
    return summed(view, node, s, "views.index")


@register(aten.cat)
def cat(view, node, split):
    parts = node.args[0]
    out = val(node)
    d = norm(arg(node, 1, "dim", 0), out.ndim)
    ps = [view.placed(a) for a in parts]
    seqs = {p for p in ps if seq_of(p) is not None}
    alike = len(seqs) == 1 and all(seq_of(p) is not None for p in ps) and seq_of(next(iter(seqs)))[0] != d
    if split and not alike:
        view.fail(node, f"concatenates {[str(p) for p in ps]} along dim {d}: only tensors split alike, "
                        "joined along another dim than the sequence")
    return summed(view, node, next(iter(seqs)) if alike else R, "views.cat")


@register(operator.getitem)
def getitem(view, node, split):
    p = view.get(node.args[0])
    return Outcome(p[node.args[1]] if isinstance(p, tuple) else R, "getitem")


@register(aten._assert_tensor_metadata)
def metadata(view, node, split):
    return Outcome(R, "metadata")
