"""How much of a model tensor parallelism actually splits.

A layout can be correct and still save nothing: a matmul whose split could not be
carried stays replicated (correctly), and a user who asked for tp=8 gets one GPU's
worth of memory per rank. This counts, from a tensor-parallel plan, the share of
parameters that are split and the share of matmul FLOPs that run split, and lists
the largest replicated matmuls with the reason the plan recorded.

FLOPs of a matmul are 2·(output elements)·(contraction length); attention
(``scaled_dot_product_attention``) counts its two matmuls, 4·b·h·s_q·s_k·d; an einsum
counts what its equation says (``einsum_flops``); a grouped matmul of experts
(``aten._grouped_mm``, transformers' ``grouped_mm_fallback``) each row by its one expert.
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
_MATMULS = {aten.linear, aten.addmm, aten.mm, aten.bmm, aten.matmul, aten.baddbmm, aten.einsum, aten._grouped_mm}
# grouped matmuls of libraries' custom ops (by qualified name: their packets exist once imported)
_MATMUL_NAMES = {"transformers::grouped_mm_fallback"}


def _is_matmul(node: fx.Node) -> bool:
    pk = getattr(node.target, "overloadpacket", None)
    return (node.op == "call_function" and pk is not None
            and (pk in _MATMULS or pk is aten.scaled_dot_product_attention
                 or getattr(pk, "_qualified_op_name", None) in _MATMUL_NAMES))


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


def einsum_flops(equation: str, shapes: List[Tuple[int, ...]]) -> float:
    """FLOPs of ``torch.einsum(equation, *operands)`` with operands of ``shapes``,
    contracted pairwise left to right (torch's order without opt_einsum): a pair costs
    2·(product of the sizes of every letter either holds) when a letter is summed away
    (one multiply and one add per term), else one multiply per term. An intermediate
    keeps the letters the output or a later operand uses. One operand (a transpose, a
    diagonal, a sum) is no matmul: 0. ``...`` stands for the broadcast dims, an implicit
    output for the letters used once, in alphabetical order (einsum's rules)."""
    eq = equation.replace(" ", "")
    ins, out = eq.split("->") if "->" in eq else (eq, None)
    specs = ins.split(",")
    if len(specs) != len(shapes):
        raise ValueError(f"einsum {equation!r} has {len(specs)} operands, got {len(shapes)} shapes")
    n_ell = max((len(sh) - len(s.replace("...", "")) for s, sh in zip(specs, shapes) if "..." in s), default=0)
    ell = "".join(chr(0x3b1 + i) for i in range(n_ell))    # letters no equation uses (greek)
    size: Dict[str, int] = {}
    terms = []
    for s, sh in zip(specs, shapes):
        if "..." in s:
            k = len(sh) - len(s.replace("...", ""))
            s = s.replace("...", ell[n_ell - k:])
        if len(s) != len(sh):
            raise ValueError(f"einsum {equation!r}: operand {s!r} has {len(sh)} dims")
        for c, d in zip(s, sh):
            size[c] = max(size.get(c, 1), d)     # a size-1 dim broadcasts
        terms.append(s)
    if out is None:
        once = [c for c in size if sum(t.count(c) for t in terms) == 1 and c not in ell]
        out = ell + "".join(sorted(once))
    else:
        out = out.replace("...", ell)
    if len(terms) < 2:
        return 0.0
    total, acc = 0.0, terms[0]
    for i, t in enumerate(terms[1:], 1):
        letters = set(acc) | set(t)
        later = set(out).union(*terms[i + 1:])
        keep = "".join(c for c in dict.fromkeys(acc + t) if c in later)
        terms_n = math.prod(size[c] for c in letters)
        total += (2.0 if letters - set(keep) else 1.0) * terms_n
        acc = keep
    return total


def _flops(node: fx.Node) -> float:
    pk = getattr(node.target, "overloadpacket", None)
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    if pk is aten.einsum:
        return einsum_flops(node.args[0], [tuple(a.meta["val"].shape) for a in node.args[1]])
    if pk is aten._grouped_mm and node.args[0].meta["val"].ndim == 2 and node.args[1].meta["val"].ndim == 2:
        # groups along the contraction: [M, K] by [K, N] into [E, M, N], each K once
        x, w = node.args[0].meta["val"], node.args[1].meta["val"]
        return 2.0 * x.shape[0] * x.shape[1] * w.shape[1]
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
        if not _is_matmul(node):
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
