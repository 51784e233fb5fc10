"""Sequence parallelism's gathers in FP8: a ``gather_seq`` whose every reader is an FP8 linear
(through ``fp8_share``'s quantisation and ``fp8_linear_q``) gathers FP8 bytes instead of
bf16 (``fxmegatron.ops.fp8_gather``).

The rewrite, for ``g = gather_seq(x, dim, world, group)`` (or ``all_gather_seq``, whose
gradient is whole on every rank):

* the one ``fp8_quantize(detach(g))`` becomes ``fp8_gather_quantize(detach(x), dim, world,
  group)``: the same four FP8 operands, quantised on the shard and gathered;
* ``g`` itself, which the linears then read only for its dtype and gradient, becomes
  ``fp8_gathered_input(x, ...)``: no forward communication, the gather's backward
  (reduce-scatter; ``fp8_gathered_whole_input``: the local slice).

Preconditions, each checked, else the gather stays bf16 and its node says why
(``meta["fp8"]``, in the dump): the graph went through ``fp8_share`` (run after it); every
reader of ``g``, or of a reshape of it that keeps its last dim or a ``copy_to_tp`` of it
(GPT-2's linears read ``g`` flattened to [tokens, features], through f), is ``detach`` →
``fp8_quantize`` (exactly one such quantisation) or ``fp8_linear_q``'s input; the quantisation's amax groups
are ``group`` or none (``g`` is the same on every rank of ``group``, so its amaxes are too);
the gathered dim is not the last (a row, one token's features, lives on one rank).
"""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.ops.collectives import all_gather_seq, copy_to_tp, gather_seq
from fxmegatron.ops.fp8_gather import fp8_gathered_input, fp8_gathered_whole_input, gather_quantize_operand
from fxmegatron.ops.fp8_operands import fp8_linear_q, quantize_operand
from fxmegatron.passes.node_meta import copy_source

aten = torch.ops.aten


# what may stand between the gather and the FP8 linears: reshapes, and Megatron's f (identity
# forward; its backward all-reduce stays where it is)
VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, copy_to_tp)


def _last_dim(n: fx.Node) -> int:
    val = n.meta.get("val")
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else -1


def _readers(n: fx.Node, k: int, quants: List[fx.Node]) -> str:
    """Collect the FP8 quantisations of ``n`` (a gathered tensor, or a reshape of it that keeps
    its last dim ``k``, so that its [tokens, k] rows are the gathered tensor's, or f of it) into ``quants``;
    "" when every reader is one or an FP8 linear's input, else the name of one that is not."""
    for u in n.users:
        if u.target is aten.detach.default and u.users and all(v.target is quantize_operand for v in u.users):
            quants.extend(u.users)
        elif u.target is fp8_linear_q and u.args[0] is n and n not in u.args[1:]:
            pass
        elif u.target in VIEWS and u.args[0] is n and _last_dim(u) == k:
            bad = _readers(u, k, quants)
            if bad:
                return bad
        else:
            return u.name
    return ""


def _quantized(n: fx.Node) -> bool:
    """An FP8 quantisation reads ``n`` or a reshape of it."""
    return any((u.target is aten.detach.default and any(v.target is quantize_operand for v in u.users))
               or (u.target in VIEWS and _quantized(u)) for u in n.users)


def _args(g: fx.Node) -> Tuple[fx.Node, int, int, int, str]:
    """(x, dim, rank, world, group) of ``gather_seq`` (rank -1) or ``all_gather_seq``."""
    if g.target is gather_seq:
        x, dim, world, group = g.args[:4]
        return x, dim, -1, world, group
    return tuple(g.args[:5])


def _plan(g: fx.Node) -> Tuple[Optional[fx.Node], str]:
    """(the quantisation to replace, "") or (None, why the gather stays bf16)."""
    x, dim, _, world, group = _args(g)
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or dim % val.dim() == val.dim() - 1:
        return None, "bf16 gather: not over tokens"
    quants: List[fx.Node] = []
    bad = _readers(g, val.shape[-1], quants)
    if bad:
        return None, f"bf16 gather: {bad} reads the gathered values"
    if len(quants) != 1:
        return None, f"bf16 gather: {len(quants)} FP8 quantisations of it (one expected)"
    q = quants[0]
    if set(q.args[2:4]) - {"", group}:
        return None, f"bf16 gather: {q.name} reduces its amaxes over {q.args[2:4]}, not the gather's {group!r}"
    return q, ""


def gather_in_fp8(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every sequence gather that only FP8 linears read (see the module docstring)."""
    g = gm.graph
    for node in [n for n in g.nodes if n.op == "call_function" and n.target in (gather_seq, all_gather_seq)]:
        q, why = _plan(node)
        if q is None:
            if _quantized(node):        # FP8 linears read it: say why their input stays bf16
                node.meta["fp8"] = why
            continue
        x, dim, rank, world, group = _args(node)
        recipe = q.args[1]
        with g.inserting_before(node):
            d = g.call_function(aten.detach.default, (x,))
            gq = g.call_function(gather_quantize_operand, (d, recipe, dim, world, group))
            outs = [g.call_function(operator.getitem, (gq, i)) for i in range(4)]
            proxy = (g.call_function(fp8_gathered_input, (x, dim, world, group)) if rank < 0 else
                     g.call_function(fp8_gathered_whole_input, (x, dim, rank, world, group)))
        d.meta["val"] = x.meta["val"]
        gq.meta["val"] = q.meta.get("val")
        for i, o in enumerate(outs):
            o.meta["val"] = q.meta["val"][i] if isinstance(q.meta.get("val"), tuple) else None
        proxy.meta["val"] = node.meta.get("val")
        for n in (d, gq, *outs, proxy):
            copy_source(n, node, also=("placements", "tp_rule"))
        gq.meta["fp8"] = f"gathered in FP8 ({recipe}): the shard quantised, its FP8 bytes gathered"
        proxy.meta["fp8"] = (f"no forward gather: {gq.name} carries the values in FP8; "
                             + ("reduce-scatter backward" if rank < 0 else "local slice backward"))
        for item in list(q.users):
            item.replace_all_uses_with(outs[item.args[1]])
            g.erase_node(item)
        old_detach = q.args[0]
        g.erase_node(q)
        g.erase_node(old_detach)
        node.replace_all_uses_with(proxy)
        g.erase_node(node)
    g.lint()
    gm.recompile()
    return gm
