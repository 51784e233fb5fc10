"""How much of a model tensor parallelism actually splits.

A layout can be correct and still save nothing: a matmul whose split could not be
carried stays replicated (correctly), and a user who asked for tp=8 gets one GPU's
worth of memory per rank. This counts, from a tensor-parallel plan, the share of
parameters that are split and the share of matmul FLOPs that run split, and lists
the largest replicated matmuls with the reason the plan recorded.

FLOPs of a matmul are 2·(output elements)·(contraction length); attention
(``scaled_dot_product_attention``) counts its two matmuls, 4·b·h·s_q·s_k·d.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.placement import Shard

aten = torch.ops.aten
_MATMULS = {aten.linear, aten.addmm, aten.mm, aten.bmm, aten.matmul, aten.baddbmm}


@dataclass
class Coverage:
    tp: int
    params_split: float            # share of parameter elements held as shards
    flops_split: float             # share of matmul FLOPs computed on split operands
    replicated: List[Tuple[str, float, str]] = field(default_factory=list)   # (where, share of FLOPs, why)

    def summary(self, top: int = 5) -> str:
        lines = [f"tp={self.tp}: {self.params_split:.0%} of parameters and {self.flops_split:.0%} of matmul "
                 "FLOPs are split"]
        for where, share, why in self.replicated[:top]:
            lines.append(f"  replicated: {where} ({share:.1%} of matmul FLOPs): {why}")
        return "\n".join(lines)


def _flops(node: fx.Node) -> float:
    pk = getattr(node.target, "overloadpacket", None)
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    if pk is aten.scaled_dot_product_attention:
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        return 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    if pk in (aten.linear,):
        k = node.args[1].meta["val"].shape[-1]
    elif pk in (aten.addmm, aten.baddbmm):
        k = node.args[1].meta["val"].shape[-1]
    else:
        k = node.args[0].meta["val"].shape[-1]
    return 2.0 * out.numel() * k


def coverage(gm: fx.GraphModule, plan, params: Dict[str, torch.Tensor]) -> Coverage:
    """``plan``: the tensor-parallel plan of ``gm`` (before the rewrite: its nodes are
    ``gm``'s nodes). ``params``: canonical name -> parameter (for sizes)."""
    total_p = sum(p.numel() for p in params.values()) or 1
    split_p = sum(p.numel() for n, p in params.items() if isinstance(plan.param_plc.get(n), Shard))
    rows, total_f, split_f = [], 0.0, 0.0
    for node in gm.graph.nodes:
        pk = getattr(node.target, "overloadpacket", None)
        if node.op != "call_function" or (pk not in _MATMULS and pk is not aten.scaled_dot_product_attention):
            continue
        f = _flops(node)
        total_f += f
        dec = plan.decisions.get(node)
        plc = plan.node_plc.get(node)
        if dec is not None:
            is_split, why = dec.kind in ("column", "row", "vocab"), dec.reason or dec.kind
        else:
            is_split = isinstance(plc, Shard) or type(plc).__name__ == "Partial"
            why = "its operands reach it whole (no split carried to it)"
        if is_split:
            split_f += f
        else:
            rows.append((f"{module_path(node) or '(top level)'} node {node.name}", f, why))
    total_f = total_f or 1.0
    rows.sort(key=lambda r: -r[1])
    return Coverage(plan.tp, split_p / total_p, split_f / total_f, [(w, f / total_f, y) for w, f, y in rows])
