"""Elementwise ops (anything tagged ``torch.Tag.pointwise``, and the few listed here)."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import is_tensor_node, packet, val, where
from fxmegatron.passes.tensor_parallel.plan import F, SLICE, SPLIT
from fxmegatron.passes.tensor_parallel.rules.opaque import replicate_all
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.passes.tensor_parallel.sequence import SEQ, reduce_partial
from fxmegatron.placement import Partial, R, Shard

aten = torch.ops.aten

# elementwise, but not tagged pointwise in ATen
_ELEMENTWISE_EXTRA = (aten.dropout, aten.type_as, aten.masked_fill, aten.where,
                      aten.alias, aten.clone, aten.contiguous, aten.detach, aten.lift_fresh_copy, aten.gelu,
                      aten.silu, aten.native_dropout)
# copies through which a partial sum stays a partial sum
_KEEP_PARTIAL = {aten.alias, aten.clone, aten.contiguous}


@register(*_ELEMENTWISE_EXTRA)
def pointwise(view, node):
    """Carries one split dim through, broadcasting as ATen does.

    Precondition: every split input is split along the same (right-aligned) dim with the
    same blocks. A whole input is then sliced to match: a parameter is claimed split the
    same way; a constant is sliced locally; a replicated activation on sequence shards is
    split (``split_seq``); an input broadcast along the split dim stays whole, with f on
    its gradient. Otherwise the split's column matmuls are demoted: inputs split along
    different dims, a parameter that must stay replicated, or a replicated activation
    with gradients (a residual add) outside sequence parallelism.
    A partial sum is reduced first (g, or reduce-scatter on sequence shards), except
    through a plain copy (alias / clone / contiguous), which keeps it partial.
    """
    pk = packet(node)
    out = val(node)
    if not isinstance(out, torch.Tensor):
        return replicate_all(view, node, "returns a non-tensor")
    nd = out.ndim
    tensors = [a for a in node.all_input_nodes if is_tensor_node(a) or a in view.free]
    partials = [a for a in tensors if isinstance(view.get(a), Partial)]
    split = [a for a, _ in view.shard_inputs(node) if SEQ not in view.orig(a)]
    if partials and not view.shard_inputs(node) and pk in _KEEP_PARTIAL and len(partials) == 1:
        view.carry_bias(partials[0], node)
        return view.set(node, view.get(partials[0]))     # a sum stays a sum, an average an average
    for a in partials:
        view.replicate(a, node) if split else reduce_partial(view, a, node)
    shards = view.shard_inputs(node)
    if not shards:
        for a in tensors:
            if view.get(a) is None:
                view.claim(a, R, where(node))
        return view.set(node, R)
    origins = set().union(*(view.orig(a) for a, _ in shards))
    dims = {(p.dim + nd - val(a).ndim, p.blocks) for a, p in shards}
    if len(dims) > 1:
        view.demote(origins, node, f"combines inputs split along different dims {sorted(map(str, dims))}")
    d, blocks = dims.pop()
    seq = SEQ in origins
    for a in tensors:
        if isinstance(view.get(a), Shard):
            continue
        ad = d - (nd - val(a).ndim)
        if ad < 0 or val(a).shape[ad] == 1:
            # broadcast along the split dim: each rank's gradient is a partial sum -> f
            if a in view.free:
                view.claim(a, R, where(node))
            if a in view.free or a in view.needs_grad:
                view.add(F, a, node)
            continue
        if a in view.free and not seq:
            if not view.claim(a, Shard(ad, blocks), where(node)):
                view.demote(origins, node, f"uses parameter {view.free[a][0]} that must stay replicated")
        elif a not in view.needs_grad and a not in view.free and blocks is None:
            view.add(SLICE, a, node, ad)
        elif seq:
            if a in view.free:
                view.claim(a, R, where(node))
            view.add(SPLIT, a, node, ad)
        else:
            view.demote(origins, node, f"combines it with the replicated activation {a.name}")
    return view.set(node, Shard(d, blocks), origins)


@register(aten.to, aten._to_copy)
def cast(view, node):
    """A dtype or device cast. Of a parameter no rule has claimed yet (a norm weight cast
    to the activations' dtype, as Cohere's per-head q/k LayerNorm does): the cast stays
    free, with the parameter's dim map, so that its consumer claims the parameter's layout
    through it, as it would on the parameter itself (casting rank r's shard gives the
    shard of the cast). Precondition: the input is such an unclaimed parameter and the
    output has its shape; otherwise an ordinary elementwise op (``pointwise``)."""
    x = node.args[0] if node.args else node.kwargs.get("self")
    if (isinstance(x, fx.Node) and x in view.free and view.get(x) is None
            and isinstance(val(node), torch.Tensor) and val(node).shape == val(x).shape):
        return view.alias(*view.free[x])
    return pointwise(view, node)
