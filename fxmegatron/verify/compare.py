"""Reassembling the ranks' values and naming the first one that differs.

A node's value on every rank, put together by its placement, is the value the
original graph computes at the node of the same name:

* ``Replicate``: every rank holds it whole (the ranks must agree);
* ``Shard(d)``: the ranks' slices, joined along d (fused blocks included);
* ``Partial``: a summand per rank, not compared here: a row-parallel matmul defers
  its bias past the reduction, so the summands leave the bias out. The reduction's
  consumers are compared instead.

Nodes the rewrite added (collectives) have no original; nodes whose placement is
unknown (a parameter's transpose before its use decides the split) are skipped, and
so are allocations (``empty_like`` and kin), whose values are whatever memory held.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.passes.expert_parallel.rewrite import EP_BLOCK, EP_REGION
from fxmegatron.placement import PLACEMENTS, Replicate, Shard, join_shards, placed


aten = torch.ops.aten
_UNINITIALISED = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| relative to max |b| (or ``floor``, for tensors that are zero in exact
    arithmetic, whose relative error is rounding noise over rounding noise)."""
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    a, b = a.double(), b.double()
    if not torch.isfinite(b).all() or not torch.isfinite(a).all():
        same = torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.equal(a[~torch.isfinite(a)],
                                                                                  b[~torch.isfinite(b)])
        if not same:
            return float("inf")
        a, b = a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)
    denom = max(b.abs().max().item() if b.numel() else 0.0, floor, 1e-30)
    return (a - b).abs().max().item() / denom if b.numel() else 0.0


def reassemble(values: Sequence, plc):
    """The whole value from every rank's, or None when the placement says it cannot be
    compared (``Partial``) or the ranks disagree on a replicated value (returned as a str)."""
    if isinstance(plc, tuple):
        parts = [reassemble([v[i] for v in values], p) for i, p in enumerate(plc)]
        return tuple(parts)
    if not isinstance(values[0], torch.Tensor):
        return values[0]
    if isinstance(plc, Shard):
        return join_shards(list(values), plc)
    if isinstance(plc, Replicate):
        for r, v in enumerate(values[1:], 1):
            if rel_err(v, values[0]) > 1e-6:
                return f"rank {r} holds another value than rank 0 (relative difference {rel_err(v, values[0]):.2e})"
        return values[0]
    return None


@dataclass
class Divergence:
    node: str
    op: str
    module: str
    placement: str
    rule: str
    detail: str
    cp: str = ""        # the context-parallel placement and rule, under cp

    def __str__(self):
        where = f" in {self.module}" if self.module else ""
        cp = f", {self.cp}" if self.cp else ""
        return (f"node {self.node} ({self.op}){where}, placed {self.placement} by rule {self.rule!r}{cp}: "
                f"{self.detail}")


def rule_of(node: fx.Node) -> str:
    return node.meta.get("tp_rule") or node.meta.get("tp_decision") or "propagation"


def first_divergence(ref_graph: fx.Graph, ref_values: Dict[str, object], rank_graph: fx.Graph,
                     rank_values: List[Dict[str, object]], rtol: float, cp=None) -> Optional[Divergence]:
    """The first node, in the original graph's order, whose reassembled value differs from
    the original's by more than ``rtol`` (relative to the original's largest magnitude).
    ``rank_values``: by tp rank, or, under context parallelism (``cp``, a ``context.CPView``),
    by cp rank, then tp rank."""
    by_name = {n.name: n for n in rank_graph.nodes}
    for ref_node in ref_graph.nodes:
        name = cp.stands_for.get(ref_node.name, ref_node.name) if cp is not None else ref_node.name
        node = by_name.get(name)
        if node is None or ref_node.name not in ref_values or "tp" not in node.meta.get(PLACEMENTS, {}):
            continue
        if node.meta.get(EP_REGION):    # expert parallelism: every ep rank's tokens, this rank's experts alone
            continue
        if getattr(node.target, "overloadpacket", None) in _UNINITIALISED:
            continue
        if any(name not in v for v in rank_values):
            continue
        plc = placed(node, "tp")
        values = [v[name] for v in rank_values]
        got = reassemble(values, plc) if cp is None else cp.reassemble(values, plc, ref_node.name)
        want = ref_values[ref_node.name]
        bad = _differs(got, want, rtol)
        if bad:
            shown = node if name == ref_node.name else ref_node      # the original op a cp op stands for
            blocks = sorted({a.meta[EP_BLOCK] for a in node.all_input_nodes if EP_BLOCK in a.meta})
            note = cp.describe(ref_node.name) if cp is not None else ""
            if blocks:
                note = (note + ", " if note else "") + (f"it reads the output of the expert-parallel block {blocks[0]} "
                                                        "(its dispatch, experts and combine over ep)")
            return Divergence(ref_node.name, str(getattr(shown.target, "__name__", shown.target)),
                              module_path(node), _plc_str(plc), rule_of(node), bad, note)
    return None


def _plc_str(plc) -> str:
    return "(" + ", ".join(map(str, plc)) + ")" if isinstance(plc, tuple) else str(plc)


def _differs(got, want, rtol) -> str:
    if got is None:
        return ""
    if isinstance(got, str):
        return got
    if isinstance(got, tuple):
        for i, (g, w) in enumerate(zip(got, want)):
            bad = _differs(g, w, rtol)
            if bad:
                return f"output {i}: {bad}"
        return ""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return ""
    if got.shape != want.shape:
        return f"reassembled shape {list(got.shape)} differs from the original's {list(want.shape)}"
    err = rel_err(got, want)
    return f"differs from the original by {err:.2e} (relative; tolerance {rtol:g})" if err > rtol else ""


def param_users(graph: fx.Graph, name: str) -> List[fx.Node]:
    """The compute nodes that read parameter ``name`` (through views of it)."""
    out, stack = [], [n for n in graph.nodes if n.op == "get_attr" and n.target == name]
    seen = set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if "tp" in u.meta.get(PLACEMENTS, {}) or u.meta.get("tp_decision") or u.meta.get("tp_rule"):
                out.append(u)
            else:
                stack.append(u)
    return out


def describe_users(graph: fx.Graph, name: str) -> str:
    users = param_users(graph, name)
    if not users:
        return "no user found"
    return "; ".join(f"node {u.name} ({getattr(u.target, '__name__', u.target)})"
                     f"{' in ' + module_path(u) if module_path(u) else ''}, rule {rule_of(u)!r}"
                     for u in users[:4])
