"""Sequence parallelism's collectives merged with their matmuls, so that they overlap.

Two patterns of the tensor-parallel graph with sequence parallelism:

* ``gather_seq(x)`` whose every user is ``linear(gathered, W, b)`` (q/k/v, the MLP's
  first linear, a vocab-parallel LM head) -> one ``gathered_linears(x, [W...], [b...])``;
* ``linear(y, W)`` (a row-parallel linear: its bias is added after the scatter) whose
  only user is ``scatter_seq`` -> ``scattered_linear(y, W)``.

The merged ops (``fxmegatron.ops.overlapped_linear``) cut the batch into ``chunks`` pieces
and run each piece's collective while the previous piece's matmuls run.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxmegatron.ops.collectives import gather_seq, scatter_seq
from fxmegatron.ops.overlapped_linear import gathered_linears, scattered_linear

aten = torch.ops.aten


def _linear_parts(n: fx.Node):
    """(input, weight, bias) of an ``aten.linear`` node, else None."""
    if n.op != "call_function" or n.target is not aten.linear.default:
        return None
    args = list(n.args) + [None] * (3 - len(n.args))
    return args[0], args[1], n.kwargs.get("bias", args[2])


def apply_tp_overlap(gm: fx.GraphModule, chunks: int, transport: str = "auto") -> int:
    """Merge the patterns above (their collectives moved by ``transport``: see
    ``overlapped_linear.TRANSPORTS``); returns how many were merged."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    merged = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is gather_seq:
            x, dim, world, group = n.args
            users = list(n.users)
            parts = [_linear_parts(u) for u in users]
            if not users or any(p is None or p[0] is not n or n in p[1:] for p in parts):
                continue
            first = min(users, key=order.__getitem__)
            ws, bs = [p[1] for p in parts], [p[2] for p in parts]
            # the weights must exist before the first linear, where the merged op goes
            if any(isinstance(a, fx.Node) and order[a] > order[first] for a in ws + bs):
                continue
            with gm.graph.inserting_before(first):
                fused = gm.graph.call_function(gathered_linears, (x, ws, bs, dim, world, group, chunks, transport))
                fused.meta = dict(first.meta)     # its block, for recomputation and pipeline cuts
                fused.meta["val"] = [u.meta.get("val") for u in users]
                for i, u in enumerate(users):
                    item = gm.graph.call_function(operator.getitem, (fused, i))
                    item.meta = dict(u.meta)
                    u.replace_all_uses_with(item)
            for u in users:
                gm.graph.erase_node(u)
            gm.graph.erase_node(n)
            merged += 1
        elif n.target is scatter_seq:
            lin, dim, world, group = n.args
            parts = _linear_parts(lin) if isinstance(lin, fx.Node) else None
            if parts is None or parts[2] is not None or len(lin.users) != 1:
                continue
            with gm.graph.inserting_before(n):
                fused = gm.graph.call_function(scattered_linear, (parts[0], parts[1], dim, world, group, chunks,
                                                                     transport))
                fused.meta = dict(n.meta)
            n.replace_all_uses_with(fused)
            gm.graph.erase_node(n)
            gm.graph.erase_node(lin)
            merged += 1
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged
