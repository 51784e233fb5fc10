"""Replace every dropout with counter-based dropout keyed by global element index.

Runs after the tensor-parallel rewrite, while ``node.meta["val"]`` still holds
the unsplit value and ``node.meta["placement"]`` how this rank holds it. See
``fxmegatron.ops.dropout`` for why this gives Megatron's RNG semantics (masks equal
across tp ranks outside tp regions, different inside) and tp-independent results.

Dropout inside fused attention (``scaled_dot_product_attention`` with
``dropout_p > 0``) becomes ``counter_dropout_attention``: attention on the math
path, with the probabilities' dropout keyed the same way.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.errors import ShardingError
from fxmegatron.placement import R
from fxmegatron.ops.dropout import DropoutRng, counter_dropout, counter_dropout_attention, local_layout, rng_key

aten = torch.ops.aten
RNG_ATTR = "fxm_rng"
_UNSUPPORTED = {aten.native_dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
                aten.feature_alpha_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
                aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default}


def _arg(node, i, name, default):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def dropout_sites(gm: fx.GraphModule):
    """The dropout nodes (p > 0) of ``gm``, in order; raises on random ops it cannot key."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.dropout.default and _arg(n, 2, "train", True) and _arg(n, 1, "p", 0.0) > 0:
            out.append(n)
        elif n.target is aten.scaled_dot_product_attention.default and _arg(n, 4, "dropout_p", 0.0) > 0:
            out.append(n)
        elif n.target in _UNSUPPORTED:
            raise ShardingError(f"node {n.name} ({n.target}) draws random numbers in a way fxmegatron cannot "
                                "key by element index; use torch.nn.functional.dropout")
    return out


def apply_counter_rng(gm: fx.GraphModule, rank: int, world: int, seed: int) -> fx.GraphModule:
    """Rewrite dropouts in place; adds a ``DropoutRng`` submodule ``fxm_rng`` when there are any."""
    sites = dropout_sites(gm)
    if not sites:
        return gm
    g = gm.graph
    gm.add_submodule(RNG_ATTR, DropoutRng(seed))
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    like = next(n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor))
    with g.inserting_after(placeholders[-1]):
        rng = g.get_attr(RNG_ATTR)
    with g.inserting_after(rng):
        key = g.call_function(rng_key, (rng, like))
    key.meta["placement"] = R
    for site, n in enumerate(sites):
        plc = n.meta.get("placement", R)
        if n.target is aten.dropout.default:
            x, p = n.args[0], _arg(n, 1, "p", 0.0)
            n.target = counter_dropout
            shape = tuple(n.meta["val"].shape)
            n.args = (x, p, True, key, site, shape) + local_layout(shape, plc, rank, world)
            n.kwargs = {}
        else:
            q, k, v = n.args[:3]
            qs, ks = q.meta["val"].shape, k.meta["val"].shape
            scores = tuple(qs[:-1]) + (ks[-2],)
            n.target = counter_dropout_attention
            n.args = (q, k, v, _arg(n, 3, "attn_mask", None), _arg(n, 4, "dropout_p", 0.0),
                      _arg(n, 5, "is_causal", False), n.kwargs.get("scale"), n.kwargs.get("enable_gqa", False),
                      key, site, scores) + local_layout(scores, plc, rank, world)
            n.kwargs = {}
        n.meta["rng_site"] = site
    g.lint()
    gm.recompile()
    return gm
