"""Rewrite a graph for one rank from a ``TPPlan``.

Megatron's f (``copy_to_tp``) where a replicated activation enters a split region, g
(``reduce_from_tp``) where a partial sum must become whole, sequence parallelism's
reduce-scatters and gathers, shape arguments of views/expands/splits divided by tp,
vocab-parallel embedding and loss. Which function realises a change of placement
(f, g, a gather, a scatter, a slice) is the redistribution table's (``passes.redistribute``,
axis "tp"). The rewritten graph expects parameters to be the
rank's local shards. Every node keeps its placement (``placed(node, "tp")``), the rule
that placed it (``meta["tp_rule"]``) and, for matmuls, embeddings and losses, the
decision (``meta["tp_decision"]``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding
from fxmegatron.passes.redistribute import Site, find, insert_edges
from fxmegatron.passes.tensor_parallel.nodes import arg, packet
from fxmegatron.passes.tensor_parallel.plan import TPPlan
from fxmegatron.placement import PLACEMENTS, Partial, R, Shard, place, placed

aten = torch.ops.aten


def _rewrite_args(g: fx.Graph, node: fx.Node, args: list, tp: int) -> None:
    """Planned arguments; a symbolic size ("floordiv", n) becomes n // tp in the graph."""
    if len(args) > 1 and isinstance(args[1], list):
        sizes = []
        for s in args[1]:
            if isinstance(s, tuple) and s[0] == "floordiv":
                with g.inserting_before(node):
                    s = g.call_function(operator.floordiv, (s[1], tp))
            sizes.append(s)
        args[1] = sizes
    node.args = tuple(args)


def _rewrite_call(node: fx.Node, plan: TPPlan, rank: int, group_name: str) -> None:
    """Row-parallel matmuls without their bias, vocab-parallel embedding and loss."""
    tp = plan.tp
    dec = plan.decisions[node]
    pk = packet(node)
    if dec.kind == "row" and node in plan.row_bias and tp > 1:
        # the bias is added after the reduction (g or reduce-scatter): see bias_after
        if pk is aten.linear:
            node.args, node.kwargs = node.args[:2], {}
        else:   # addmm(b, x, w) -> mm(x, w)
            node.target, node.args, node.kwargs = aten.mm.default, (node.args[1], node.args[2]), {}
    elif dec.kind == "vocab" and pk is aten.embedding:
        w, ids = node.args[0], node.args[1]
        vocab = node.args[0].meta["val"].shape[0] // tp
        pad = arg(node, 2, "padding_idx", -1)     # ATen's: -1 for none
        local_pad = pad - rank * vocab if 0 <= pad - rank * vocab < vocab and pad >= 0 else None
        node.target, node.args, node.kwargs = vocab_parallel_embedding, (w, ids, rank * vocab, local_pad), {}
    elif dec.kind == "vocab" and pk is aten.cross_entropy_loss:
        logits, target = node.args[0], node.args[1]
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
        ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
        vocab = logits.meta["val"].shape[1] // tp
        node.target = vocab_parallel_cross_entropy
        node.args, node.kwargs = (logits, target, rank * vocab, group_name, reduction, ignore), {}


def apply_tensor_parallel(gm: fx.GraphModule, plan: TPPlan, rank: int, group_name: str) -> fx.GraphModule:
    """Rewrite ``gm`` in place for one rank from ``plan`` (parameters become local shards)."""
    g = gm.graph
    tp = plan.tp

    def mark(n, plc):
        place(n, "tp", plc)
        return n

    for node in list(g.nodes):
        if node in plan.rules:
            node.meta["tp_rule"] = plan.rules[node]
        if node in plan.arg_rewrites:
            _rewrite_args(g, node, list(plan.arg_rewrites[node]), tp)
        dec = plan.decisions.get(node)
        if dec is None:
            continue
        node.meta["tp_decision"] = f"{dec.kind}" + (f": {dec.reason}" if dec.reason else "")
        _rewrite_call(node, plan, rank, group_name)

    def redistribute(src, forward, backward, plc, dim=None):
        """A node after ``src`` changing its placement (the table's op for the change)."""
        red = find("tp", forward, backward)
        return insert_after(src, red.op, red.args(src, Site(rank, tp, group_name, dim)), plc)

    def insert_after(src, fn, args, plc, rule="collective"):
        """A node after ``src`` computing (a placement of) the same value."""
        with g.inserting_after(src):
            n = g.call_function(fn, args)
        return decorate(src, n, plc, rule)

    def decorate(src, n, plc, rule="collective"):
        n.meta["nn_module_stack"] = src.meta.get("nn_module_stack")
        n.meta["tp_rule"] = rule
        if "val" in src.meta:   # values stay whole-tensor metadata, as everywhere before the local shapes
            n.meta["val"] = src.meta["val"]
        return mark(n, plc)

    def with_bias(src, red, f_bias):
        """A deferred row-parallel bias, added after the reduction."""
        b = plan.bias_after.get(src) if tp > 1 else None    # at tp=1 the bias stays in the matmul
        if b is None:
            return red
        if f_bias:   # on sequence shards each rank sees part of the bias's gradient
            b = redistribute(b, "R->R", "P->R", R)        # f
        with g.inserting_after(red):
            out = g.call_function(aten.add.Tensor, (red, b))
        out.meta["nn_module_stack"] = red.meta.get("nn_module_stack")
        out.meta["tp_rule"] = "matmul.row (bias after the reduction)"
        if "val" in red.meta:
            out.meta["val"] = red.meta["val"]
        return mark(out, placed(red, "tp"))

    def finish(e, src, anchor, new):
        decorate(src, new, R if e.forward.endswith("R") else Shard(e.dim))
        if e.forward.startswith("P->"):     # a row-parallel bias is added after the reduction
            new = with_bias(src, new, e.forward == "P->S")
        plc = plan.node_plc.get(src)
        if e.forward.startswith("P->") and isinstance(plc, Partial) and plc.op == "avg" and tp > 1:
            # the ranks' means of equal parts summed: the whole mean is that sum / tp
            with g.inserting_after(new):
                avg = g.call_function(aten.div.Tensor, (new, tp))
            decorate(new, avg, placed(new, "tp"), "reductions.mean (the ranks' means averaged)")
            new = avg
        return new

    insert_edges(g, plan.edges(), lambda e: Site(rank, tp, group_name, e.dim), finish)
    for (node, i), (dim, spans, f_here) in plan.head_slices.items():
        # the kv heads this rank's query heads use, out of a key/value every rank holds whole
        # (last: the input may have been reduced or gathered for this attention above)
        src = x = node.args[i]
        if f_here:
            x = redistribute(x, "R->R", "P->R", R)        # f
        start, length = spans[rank]
        heads = src.meta["val"].shape[dim]
        if (start, length) != (0, heads):
            # rank r holding slice r is Shard(dim); ranks sharing kv heads hold no placement of src
            regular = length * tp == heads and all(s == r * length for r, (s, _) in enumerate(spans))
            x = insert_after(x, aten.slice.Tensor, (x, dim, start, start + length), Shard(dim) if regular else None,
                             f"attention.kv_heads {start}:{start + length} of {src.name}")
        node.update_arg(i, x)
    for node, plc in plan.node_plc.items():
        if node.graph is g and "tp" not in node.meta.get(PLACEMENTS, {}):
            place(node, "tp", plc)
    for node in g.nodes:
        if node.op == "get_attr" and node.target in plan.param_plc:
            place(node, "tp", plan.param_plc[node.target])
    g.lint()
    gm.recompile()
    return gm
