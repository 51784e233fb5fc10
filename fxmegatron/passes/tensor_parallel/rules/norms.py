"""Normalisation layers (RMSNorm written out in ATen falls to the reduction and
pointwise rules)."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import norm, val, where
from fxmegatron.passes.tensor_parallel.plan import F
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.passes.tensor_parallel.sequence import reduce_partial
from fxmegatron.placement import Partial, R, Shard

aten = torch.ops.aten


@register(aten.layer_norm)
def layer_norm(view, node):
    """Normalises the trailing ``normalized_shape`` dims. A partial sum is reduced first
    (reduce-scatter on sequence shards, else g). Precondition for a split input: it is
    split along a dim that is not normalised (the sequence); weight and bias stay whole,
    with f on their gradients (each rank sees part of the rows). A split along a
    normalised dim demotes the matmuls it came from."""
    x, shape = node.args[0], node.args[1]
    if isinstance(view.get(x), Partial):
        reduce_partial(view, x, node)
    p = view.get(x)
    nd = val(x).ndim
    for a in node.args[2:4]:
        if isinstance(a, fx.Node):
            if a in view.free:
                view.claim(a, R, where(node))
            else:
                view.replicate(a, node)
            if isinstance(p, Shard) and (a in view.free or a in view.needs_grad):
                view.add(F, a, node)   # grads are partial sums
    if isinstance(p, Shard):
        if norm(p.dim, nd) >= nd - len(shape):
            view.demote(view.orig(x), node, "normalises over the split dim")
        return view.set(node, p, view.orig(x))
    return view.set(node, R)
