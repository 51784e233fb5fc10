"""The graph of one cp rank from a ``CPPlan``: takes, attention, sums and local sizes. A take
(whole -> this rank's chunks) and a sum (partial -> whole) are the redistribution table's
rows for axis "cp" (``passes.redistribute``)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxmegatron.ops.context_parallel import cp_attention, cp_count
from fxmegatron.passes.context_parallel.propagate import CPPlan
from fxmegatron.passes.expert_parallel.region import scale_tokens
from fxmegatron.passes.redistribute import Site, insert_edges
from fxmegatron.passes.tensor_parallel.nodes import arg
from fxmegatron.placement import place

aten = torch.ops.aten
_KEEP_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


def _call(gm, fn, args, like: fx.Node, after: fx.Node = None, before: fx.Node = None):
    ctx = gm.graph.inserting_after(after) if after is not None else gm.graph.inserting_before(before)
    with ctx:
        n = gm.graph.call_function(fn, args)
    n.meta.update({k: like.meta[k] for k in _KEEP_META if k in like.meta})
    return n


def apply_context_parallel_plan(gm: fx.GraphModule, plan: CPPlan, rank: int, group_name: str, variant: str):
    cp, seq = plan.cp, plan.seq
    def finish(e, src, anchor, new):
        new.meta.update({k: anchor.meta[k] for k in _KEEP_META if k in anchor.meta})
        return new

    # takes (cp_take, before the first consumer: the value may be a graph input), then sums
    insert_edges(gm.graph, plan.edges(), lambda e: Site(rank, cp, group_name, e.dim, e.inner, seq), finish)
    for node, (i, d) in plan.sizes.items():
        sizes = list(node.args[i])
        if sizes[d] != -1:
            sizes[d] = sizes[d] // cp
        node.args = node.args[:i] + (sizes,) + node.args[i + 1:]
    for node in plan.token_sizes:
        scale_tokens(node, lambda size: size // cp)
    for node, ignore in plan.mean_losses.items():
        args = list(node.args) + [None] * (5 - len(node.args))
        kw = dict(node.kwargs)
        args[2] = arg(node, 2, "weight", None)
        args[3] = 2                              # sum over this rank's tokens
        args[4] = ignore
        kw.pop("weight", None), kw.pop("reduction", None), kw.pop("ignore_index", None)
        node.args, node.kwargs = tuple(args), kw
        users = list(node.users)
        count = _call(gm, cp_count, (node.args[1], ignore, group_name), node, after=node)
        # no counted token on any cp rank (a microbatch whose answers were all cut away): the
        # mean is NaN, as ATen's 0/0, but its gradient 0 for the step that weights it 0, not
        # 0 · 1/0 (which the fused cross-entropy's backward would carry into every row)
        safe = _call(gm, aten.clamp_min.default, (count, 1), node, after=count)
        quotient = _call(gm, aten.div.Tensor, (node, safe), node, after=safe)
        counted = _call(gm, aten.gt.Scalar, (count, 0), node, after=quotient)
        mean = _call(gm, aten.where.ScalarOther, (counted, quotient, float("nan")), node, after=counted)
        for u in users:
            u.replace_input_with(node, mean)
    for node, k in plan.mean_divisor.items():
        users = list(node.users)
        d = _call(gm, aten.div.Tensor, (node, k), node, after=node)
        for u in users:
            u.replace_input_with(node, d)
    for node in plan.attention:
        q, k, v = node.args[:3]
        causal = bool(arg(node, 5, "is_causal", False))
        scale = arg(node, 6, "scale", None)
        both = _call(gm, cp_attention, (q, k, v, causal, scale, group_name, cp, rank, variant), node, before=node)
        out = _call(gm, operator.getitem, (both, 0), node, after=both)
        out.meta["cp_replaces"] = node.name     # what verify compares it with
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    for n, p in plan.plc.items():
        if n.graph is gm.graph:
            place(n, "cp", p)
    gm.graph.lint()
    gm.recompile()
    return gm
