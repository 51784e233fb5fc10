"""One FP8 quantisation per operand: every ``fp8_linear`` becomes ``fp8_quantize`` nodes for
its input and weight and an ``fp8_linear_q`` over them (``fxmegatron.ops.fp8_operands``).

Linears that read the same activation with the same recipe and amax groups (q, k and v of
one attention; gate and up of one MLP) share one ``fp8_quantize`` node, placed before the
first of them (``fp8_linear_q`` takes x as [tokens, in]: reshapes around it, as linear's
own): the activation is read once for FP8 in forward, and its transposed copy,
which the weight gradients read, is written in that same pass instead of being cast again
from the saved high-precision input in backward. The program's values do not change: each
linear's operands are the FP8 bytes ``fp8_linear`` would make (same amax, same scale).

Preconditions: the graph went through ``passes/fp8.py`` (its ``fp8_linear`` nodes carry x,
w, b, the recipe, the tp group and the split). Nodes are shared only when their arguments
are the same node with the same recipe and groups, so that sharing is a common
subexpression, never a guess. The quantised operands are computed from ``detach``ed inputs:
gradients reach x and w through ``fp8_linear_q`` alone.
"""
from __future__ import annotations

import operator
from typing import Dict, Tuple

import torch
import torch.fx as fx

from fxmegatron.ops.fp8 import fp8_linear, recipe_of
from fxmegatron.ops.fp8_operands import fp8_linear_q, operand_groups, quantize_operand
from fxmegatron.passes.node_meta import copy_source

aten = torch.ops.aten


def _quantize_node(g: fx.Graph, before: fx.Node, x: fx.Node, recipe: str, groups: Tuple[str, str]):
    with g.inserting_before(before):
        d = g.call_function(aten.detach.default, (x,))
        q = g.call_function(quantize_operand, (d, recipe, *groups))
        outs = tuple(g.call_function(operator.getitem, (q, i)) for i in range(4))
    val = x.meta.get("val")
    if isinstance(val, torch.Tensor):
        d.meta["val"] = val
        k = val.shape[-1]
        m = val.numel() // max(k, 1)
        rowwise = recipe_of(recipe).rowwise
        shapes = ((m, k), (m, 1) if rowwise else (), (k, m), (k, 1) if rowwise else ())
        dtypes = (torch.float8_e4m3fn, torch.float32) * 2
        vals = tuple(val.new_empty(s, dtype=t) for s, t in zip(shapes, dtypes))
        q.meta["val"] = vals
        for o, v in zip(outs, vals):
            o.meta["val"] = v
    for n in (d, q, *outs):
        copy_source(n, before)
    return outs


def _val(n: fx.Node) -> torch.Tensor:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"fp8_share: node {n.name} has no tensor in meta['val'] (run after shape propagation)")
    return val


def _view(g: fx.Graph, n: fx.Node, shape, like: fx.Node) -> fx.Node:
    """``n`` reshaped (a view where strides allow, as linear's own flattening is)."""
    v = g.call_function(aten.reshape.default, (n, list(shape)))
    v.meta["val"] = _val(n).reshape(shape)
    copy_source(v, like)
    return v


def share_fp8_quantization(gm: fx.GraphModule) -> fx.GraphModule:
    """Split every ``fp8_linear`` of ``gm`` into shared quantisations and ``fp8_linear_q``
    (see the module docstring)."""
    g = gm.graph
    made: Dict[tuple, tuple] = {}
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not fp8_linear:
            continue
        x, w, b, recipe, group, split = node.args[:6]
        operands = []
        for role, t in (("x", x), ("w", w)):
            groups = operand_groups(recipe, group, split, role)
            key = (t, recipe, groups)
            if key not in made:
                made[key] = _quantize_node(g, node, t, recipe, groups)
            operands.extend(made[key])
        with g.inserting_before(node):
            x2 = _view(g, x, (-1, _val(x).shape[-1]), node) if _val(x).dim() != 2 else x
            new = g.call_function(fp8_linear_q, (x2, w, b, recipe, group, split, *operands))
            new.meta.update(node.meta)
            new.meta["val"] = _val(node).reshape(-1, _val(node).shape[-1])
            out = _view(g, new, tuple(_val(node).shape), node) if _val(node).dim() != 2 else new
        node.replace_all_uses_with(out)
        g.erase_node(node)
    g.lint()
    gm.recompile()
    return gm
