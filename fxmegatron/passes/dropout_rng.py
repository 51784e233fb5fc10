"""Replace every dropout with counter-based dropout keyed by global element index.

Runs after the tensor-parallel rewrite, while ``node.meta["val"]`` still holds
the unsplit value and ``placed(node, "tp")`` how this rank holds it. See
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
from fxmegatron.passes.tensor_parallel.nodes import where
from fxmegatron.placement import R, place, placed
from fxmegatron.ops.dropout import DropoutRng, counter_dropout, counter_dropout_attention, local_layout, rng_key

aten = torch.ops.aten
RNG_ATTR = "fxm_rng"
# the ops rewritten to keyed forms; every other op ATen tags as drawing from the generator is
# refused where it draws (``random_ops`` is the whole set, so a new random op cannot slip by)
KEYED = (aten.dropout.default, aten.scaled_dot_product_attention.default)


def _arg(node, i, name, default):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def is_random(op) -> bool:
    """Whether ``op`` may draw from torch's generator: ATen's own tag, not a list of names."""
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def random_ops():
    """Every ATen overload tagged as drawing random numbers."""
    out = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out += [op for op in (getattr(packet, ov) for ov in packet.overloads()) if is_random(op)]
    return out


def draws(node: fx.Node) -> bool:
    """Whether a random op draws at this call: not a dropout of probability 0 (attention's, an
    RNN's between layers), nor one whose train flag is off."""
    args = node.target._schema.arguments
    for i, a in enumerate(args):
        v = _arg(node, i, a.name, a.default_value if a.has_default_value() else None)
        dropout = a.name in ("dropout_p", "dropout") or (a.name == "p" and "dropout" in node.target.name())
        if (dropout and isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0) or \
                (a.name in ("train", "training") and v is False):
            return False
    return True


def _calls(gm: fx.GraphModule):
    """Every call of ``gm``, the bodies of its higher-order ops (a no_grad region) included."""
    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            yield from (n for n in mod.graph.nodes if n.op == "call_function")


def dropout_sites(gm: fx.GraphModule):
    """The dropout nodes (p > 0) of ``gm``, in order; raises on every other op that draws random
    numbers (``is_random``), which it cannot key by element index."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.dropout.default and _arg(n, 2, "train", True) and _arg(n, 1, "p", 0.0) > 0:
            out.append(n)
        elif n.target is aten.scaled_dot_product_attention.default and _arg(n, 4, "dropout_p", 0.0) > 0:
            out.append(n)
    for n in _calls(gm):
        if is_random(n.target) and n.target not in KEYED and draws(n):
            raise ShardingError(
                f"{where(n)} draws random numbers ({n.target}), which fxmegatron cannot key by element index "
                "as it keys dropout (one mask wherever a tensor is whole, the same again in recomputation): "
                "drawn from each rank's generator, tensor-parallel ranks would draw different numbers and their "
                "replicated weights drift apart, silently. Turn this randomness off in the model (a router's "
                "jitter noise, for one: set it to 0; or eval mode), or write it as torch.nn.functional.dropout")
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
    place(key, "tp", R)
    for site, n in enumerate(sites):
        plc = placed(n, "tp", R)
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
