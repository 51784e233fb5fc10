"""From the experts back to the tokens: the walk forward from the block's last expert matmul to
the combine (the sum that returns each token's rows to it), the expert biases, the router's
linear and the shared experts added to the combine.

COMBINE: the last matmul's result reaches a sum over each token's rows through single-reader
ops only: casts, reshapes, an expert-bias add (BIAS), a scale by the routing weights (an
operand that is, through casts, reshapes and the gather of sorted rows, [T, k] for a routed
dispatch, or a constant), and for sorted rows the index by the inverse permutation
(UNPERMUTE). The sum removes one dim of size k (E for a dense dispatch) and leaves [T, h].
"""
from __future__ import annotations

import operator
from typing import Collection, Dict, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.passes.expert_parallel.descriptor import SORTED, SharedExperts
from fxmegatron.passes.expert_parallel.dispatch import Dispatch, Parts
from fxmegatron.passes.expert_parallel.trail import (CASTS, RESHAPES, SPLITS, Step, Trail, ancestors, describe, is_call,
                                                     is_item, linear_weight, under)
from fxmegatron.passes.tensor_parallel.nodes import arg, norm, packet, val

aten = torch.ops.aten

COMBINE = Step("combine", "the last expert matmul's result to reach, through single-reader casts, reshapes, an "
                          "expert-bias add, a scale by the routing weights and (sorted rows) the index by the "
                          "inverse permutation, a sum over one dim of size {n} leaving [T, h] = {shape}")
UNPERMUTE = Step("unpermute", "sorted rows to return to (token, choice) order before the sum, through "
                              "index(rows, [inverse]) with inverse = index_put_(empty_like(perm), [perm], arange), "
                              "argsort(perm) or sort(perm)[1]")
BIAS = Step("bias", "an expert bias to be index(bias [E, out], [the rows' expert ids]) added to the matmul's result")

_MAX_STEPS = 24


def _bias_gather(x, grouped_by, num_experts: int, params: Collection[str]):
    """(bias parameter, its gather) when ``x`` is ``bias[grouped_by]`` of an [E, out] parameter."""
    g = under(x, CASTS)
    if not (is_call(g, aten.index) and len(g.args[1]) == 1 and under(g.args[1][0], CASTS) is grouped_by):
        return None, None
    p = g.args[0]
    if p.op == "get_attr" and p.target in params and val(p).ndim == 2 and val(p).shape[0] == num_experts:
        return p.target, g
    return None, None


def expert_bias(mm: fx.Node, grouped_by, num_experts: int, params: Collection[str]):
    """(bias parameter, its gather) when ``mm``'s result (through single-reader casts and
    reshapes) is added ``bias[grouped_by]``; (None, None) otherwise."""
    cur = mm
    while len(cur.users) == 1 and packet(next(iter(cur.users))) in (CASTS | RESHAPES):
        cur = next(iter(cur.users))
    add = next(iter(cur.users)) if len(cur.users) == 1 else None
    if grouped_by is None or not is_call(add, aten.add, aten.add_) or add.args[0] is not cur:
        return None, None
    return _bias_gather(add.args[1], grouped_by, num_experts, params)


def _is_inverse(inv, perm: fx.Node) -> bool:
    inv = under(inv, CASTS)
    if is_call(inv, aten.index_put_, aten.index_put):
        return list(inv.args[1]) == [perm] and is_call(inv.args[2], aten.arange)
    if is_call(inv, aten.argsort):
        return inv.args[0] is perm
    return is_item(inv, aten.sort, 1) and inv.args[0].args[0] is perm


def _routing_weights(x, parts: Parts, num_rows_per_token: int):
    """The [T, k] weights ``x`` is (through casts, reshapes and the gather of sorted rows)."""
    w = under(x, CASTS | RESHAPES)
    if parts.permutation is not None and is_call(w, aten.index) and list(w.args[1]) == [parts.permutation]:
        w = under(w.args[0], CASTS | RESHAPES)
    shape = tuple(val(w).shape) if isinstance(w, fx.Node) and isinstance(val(w), torch.Tensor) else ()
    return w if shape == (val(parts.tokens).shape[0], num_rows_per_token) else None


def find_combine(last: fx.Node, parts: Parts, dispatch: Dispatch, num_experts: int, trail: Trail,
                 params: Collection[str]) -> Tuple[Optional[fx.Node], fx.Node, Optional[fx.Node]]:
    """(unpermute, combine, routing weights) forward of the last expert matmul ``last``."""
    n = num_experts if dispatch.reduces == "E" else parts.top_k
    tokens, hidden = val(parts.tokens).shape[0], val(parts.tokens).shape[-1]
    step = Step(COMBINE.name, COMBINE.requires.format(n=n, shape=[tokens, hidden]))
    cur, unpermute, weights = last, None, parts.weights
    for _ in range(_MAX_STEPS):
        users = list(cur.users)
        trail.expect(len(users) == 1, step, lambda: f"{describe(cur)} has {len(users)} readers "
                                                    f"({', '.join(describe(u) for u in users)})")
        u = users[0]
        trail.see(u)
        pk = packet(u)
        others = [a for a in u.all_input_nodes if a is not cur]
        if pk is aten.sum:
            dims = arg(u, 1, "dim")
            x = val(cur)
            d = norm(dims[0], x.ndim) if isinstance(dims, (list, tuple)) and len(dims) == 1 else None
            trail.expect(d is not None and x.shape[d] == n and tuple(val(u).shape) == (tokens, hidden), step,
                         lambda: f"{describe(u)} sums dims {dims} of {list(x.shape)} into {list(val(u).shape)}")
            if dispatch.name == SORTED:
                trail.expect(unpermute is not None, UNPERMUTE, "the rows reach the sum in sorted order")
            return unpermute, u, weights
        if pk in CASTS or pk in RESHAPES:
            pass
        elif pk in (aten.add, aten.add_) and len(others) == 1 and parts.grouped_by is not None:
            trail.expect(_bias_gather(others[0], parts.grouped_by, num_experts, params)[0] is not None, BIAS,
                         lambda: f"{describe(u)} adds {describe(others[0])}")
        elif pk is aten.mul and not others:
            pass            # a constant scale
        elif pk is aten.mul and len(others) == 1 and dispatch.reduces == "k":
            w = _routing_weights(others[0], parts, parts.top_k)
            trail.expect(w is not None, step, lambda: f"{describe(u)} scales the rows by {describe(others[0])}, "
                                                      f"not by the [T, k] routing weights")
            weights = w
        elif pk is aten.index and dispatch.name == SORTED and u.args[0] is cur and len(u.args[1]) == 1:
            trail.expect(_is_inverse(u.args[1][0], parts.permutation), UNPERMUTE,
                         lambda: f"{describe(u)} indexes the rows by {describe(u.args[1][0])}")
            unpermute = u
        else:
            trail.fail(step, f"the rows reach {describe(u)}")
        cur = u
    trail.fail(step, f"no sum within {_MAX_STEPS} ops")


def router_matmul(topk: fx.Node, num_experts: int, params: Collection[str]) -> Tuple[Optional[fx.Node], Optional[str]]:
    """The linear whose [T, E] logits the top-k ranks (breadth first from its scores, 24 ops)."""
    todo, seen = [topk.args[0]], set()
    while todo and len(seen) < 24:
        n = todo.pop(0)
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        name = linear_weight(n, params)
        if name is not None and val(n).shape[-1] == num_experts:
            return n, name
        if name is None:
            todo.extend(n.all_input_nodes)
    return None, None


def _mlp_op(n: fx.Node) -> bool:
    """An op of a shared expert besides its linears: elementwise, a cast, a reshape, a split."""
    if n.op == "get_attr":
        return True
    if n.op != "call_function":
        return False
    return (n.target is operator.getitem or packet(n) in (CASTS | RESHAPES | SPLITS)
            or torch.Tag.pointwise in getattr(n.target, "tags", ()))


def find_shared(combine: fx.Node, tokens: fx.Node, params: Collection[str],
                order: Dict[fx.Node, int]) -> Optional[SharedExperts]:
    """Shared experts: the combine (through single-reader casts and reshapes) is added to a value
    that is not computed before the block's tokens; its matmuls are the linears over parameters
    between the tokens and that add, its gate a ``sigmoid(linear)`` scaling it."""
    cur = combine
    while len(cur.users) == 1 and packet(next(iter(cur.users))) in (CASTS | RESHAPES):
        cur = next(iter(cur.users))
    join = next(iter(cur.users)) if len(cur.users) == 1 else None
    if join is None or not is_call(join, aten.add, aten.add_):
        return None
    others = [a for a in join.args[:2] if isinstance(a, fx.Node) and a is not cur]
    before = ancestors(tokens)
    if len(others) != 1 or others[0] in before:
        return None
    found, todo, seen = [], [others[0]], set()
    while todo:
        n = todo.pop()
        if n in seen or n in before:
            continue
        seen.add(n)
        name = linear_weight(n, params)
        if name is not None:
            found.append((n, name))
        elif not _mlp_op(n):
            return None     # not an MLP of the tokens (attention beside the experts, ...)
        todo.extend(n.all_input_nodes)
    if not found:
        return None
    found.sort(key=lambda m: order[m[0]])
    gate = None
    scaled = under(others[0], CASTS)
    if is_call(scaled, aten.mul):
        for a in scaled.args[:2]:
            s = under(a, CASTS)
            if is_call(s, aten.sigmoid) and under(s.args[0], CASTS) in {m for m, _ in found}:
                gate = under(s.args[0], CASTS)
    return SharedExperts(join, tuple(found), gate)
