"""Rows gathered by an index tensor: ``x[idx]`` (``aten.index``), as a mixture's experts add
each row's expert bias (gpt-oss: ``bias[expert_of_row]``)."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import norm, val, where
from fxmegatron.passes.tensor_parallel.rules.opaque import replicate_all
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.placement import Partial, R, Shard

aten = torch.ops.aten


@register(aten.index)
def index(view, node):
    """``x[idx]`` with one whole index tensor for dim 0: the output is ``idx``'s dims then
    ``x``'s others. ``x`` split along a later dim carries that split (moved by ``idx``'s dims);
    of a parameter no rule has claimed yet, the output stays free, its gathered dims mapped to
    no parameter dim, so that its consumer claims the parameter's layout through it (an expert
    bias split with its expert's output features). Precondition: one index tensor, at dim 0;
    ``x`` not split along dim 0. Otherwise replicated (a split demoted)."""
    x, indices = node.args[0], node.args[1]
    idx = indices[0] if len(indices) == 1 else None
    if not isinstance(idx, fx.Node) or val(idx) is None or val(x) is None:
        return replicate_all(view, node, "indexes with several index tensors, or not along dim 0")
    k = val(idx).ndim
    if isinstance(view.get(idx), Shard):
        return replicate_all(view, node, "indexes by a split index tensor")
    view.replicate(idx, node)
    p = view.get(x)
    if p is None:
        pname, dmap = view.free[x]
        return view.alias(pname, (None,) * k + tuple(dmap[1:]))
    if isinstance(p, Partial):
        view.replicate(x, node)
        return view.set(node, R)
    if isinstance(p, Shard):
        d = norm(p.dim, val(x).ndim)
        if d == 0:
            return replicate_all(view, node, f"gathers rows along the split dim at {where(node)}")
        return view.set(node, Shard(d - 1 + k, p.blocks), view.orig(x))
    return view.set(node, R)
