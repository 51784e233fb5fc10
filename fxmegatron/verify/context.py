"""Context parallelism's part of the comparison: a node's value put together from the cp ranks.

Each cp rank runs the whole model on its part of the sequence (chunks r and 2·cp−1−r of
2·cp), so a node's value on every rank, first joined over the tp ranks of each cp rank
(``compare.reassemble``), then over the cp ranks by the node's context-parallel placement
(``CPPlan.plc``), is the original graph's value at that node:

* a sequence shard ``Shard(d, seq_inner=i)``: the ranks' chunks, put back in sequence order
  along d;
* ``P``: a summand per rank (a sum over the sequence): their sum;
* whole (``R``, or ``Replicate(seq=...)``: a sequence known but not split): every rank holds
  it (they must agree).

Three kinds of node hold no share of the original's value and are not compared: a mean loss
the rewrite turned into this rank's sum (its divisor, the count over every rank, comes in a
node of its own), a mean over the sequence, divided by cp in a node after it, and the rows
inside a mixture-of-experts block (this rank's tokens' rows in the dispatch's order; the
block's combine is compared). Attention
is replaced by ``cp_attention``: its output node stands for the original attention node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.fx as fx

from fxmegatron.passes.context_parallel.layout import is_split, join_sequence, seq_of
from fxmegatron.placement import P, Placement
from fxmegatron.verify.compare import reassemble, rel_err

CP_PLAN = "fxmegatron/cp_plan"      # where apply_context_parallel leaves its plan, in GraphModule.meta


@dataclass
class CPView:
    cp: int
    tp: int
    seq: int
    plc: Dict[str, object] = field(default_factory=dict)       # original node name -> cp placement
    rules: Dict[str, str] = field(default_factory=dict)        # original node name -> cp rule
    skip: Set[str] = field(default_factory=set)
    stands_for: Dict[str, str] = field(default_factory=dict)   # original node name -> the rank's node

    def reassemble(self, values: Sequence, tp_plc, name: str):
        """The whole value of original node ``name`` from every rank's (cp rank-major), None when
        it cannot be compared, or a str saying how the ranks disagree."""
        if name in self.skip:
            return None
        per_cp = [reassemble(values[c * self.tp:(c + 1) * self.tp], tp_plc) for c in range(self.cp)]
        return join_cp(per_cp, self.plc.get(name), self.seq)

    def describe(self, name: str) -> str:
        if name not in self.plc:
            return ""
        p = self.plc[name]
        shown = "(" + ", ".join(map(str, p)) + ")" if isinstance(p, tuple) else str(p)
        return f"cp {shown} by cp rule {self.rules.get(name, 'propagation')!r}"


def cp_view(gm: fx.GraphModule, tp: int) -> Optional[CPView]:
    """The view of a rank's graph that context parallelism rewrote (None without cp)."""
    plan = gm.meta.get(CP_PLAN)
    if plan is None:
        return None
    view = CPView(plan.cp, tp, plan.seq, {n.name: p for n, p in plan.plc.items()},
                  {n.name: r for n, r in plan.rules.items()},
                  {n.name for n in plan.mean_losses} | {n.name for n in plan.mean_divisor}
                  | {n.name for n in plan.experts})
    view.stands_for = {n.meta["cp_replaces"]: n.name for n in gm.graph.nodes if "cp_replaces" in n.meta}
    return view


def join_cp(values: List, plc, seq: int):
    """``values`` (one per cp rank, each already whole over tp) joined by the cp placement."""
    if any(v is None for v in values):
        return None
    for c, v in enumerate(values):
        if isinstance(v, str):
            return f"on cp rank {c}: {v}"
    if isinstance(plc, tuple) and isinstance(values[0], (tuple, list)):
        return tuple(join_cp([v[i] for v in values], p, seq) for i, p in enumerate(plc))
    if not isinstance(values[0], torch.Tensor):
        return values[0]
    if is_split(plc):
        return join_sequence(values, plc, seq)
    if plc == P:
        return sum(values[1:], values[0])
    for c, v in enumerate(values[1:], 1):
        if rel_err(v, values[0]) > 1e-6:
            return (f"whole on every cp rank ({plc}), but cp rank {c} holds another value than cp rank 0 "
                    f"(relative difference {rel_err(v, values[0]):.2e})")
    return values[0]


def sum_over_cp(per_cp: List[List[Dict[str, torch.Tensor]]]) -> List[Dict[str, torch.Tensor]]:
    """By pipeline rank, each parameter's gradient summed over the cp ranks (what GradSync's sum
    over dp × cp adds: every cp rank holds the gradient of its tokens' share of the loss)."""
    out = []
    for r in range(len(per_cp[0])):
        total: Dict[str, torch.Tensor] = {}
        for grads in per_cp:
            for k, g in grads[r].items():
                total[k] = g.clone() if k not in total else total[k] + g
        out.append(total)
    return out
