"""Placement propagation: the planning state, its helpers and the restart loop.

``State`` walks the ATen graph once per attempt and gives every tensor a placement
(Replicate / Shard(dim) / Partial) from the rule the table (``rules.rule_for``) has
for its op: the rule reads a ``View`` and returns an ``Outcome`` (``view.py``), which
``State.record`` writes into the plan. A rule that finds a split it cannot carry
*demotes* the column matmuls the split came from (their origins) to replicated, with
why; ``record`` keeps what the outcome learnt and raises ``Restart``, and propagation
starts again. The loop ends at a fixed point: every attempt learns something new or
finishes.

Parameters are *free* until a rule claims a layout for them (``View.claim``): a weight is
split the way its first matmul wants, and a parameter two rules want differently is
forced replicated (again with a restart).
"""
from __future__ import annotations

from typing import Dict, Set, Tuple

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import packet, val, where
from fxmegatron.passes.tensor_parallel.plan import TPPlan
from fxmegatron.passes.tensor_parallel.rules import rule_for
from fxmegatron.passes.tensor_parallel.view import UNSET, Outcome, Stop, View
from fxmegatron.passes.walk import Restart, walk
from fxmegatron.placement import R

aten = torch.ops.aten

_NO_GRAD = {aten.detach, aten.lift_fresh_copy}


class State:
    """What propagation holds. Kept across attempts: the constraints learnt so far
    (``demoted`` matmuls, ``forced_rep`` parameters, ``blocks_req`` fused blocks,
    ``force_gather`` edges). Rebuilt per attempt (``reset``): the plan, the placement
    of every node, the free parameters and the origins of every split."""

    def __init__(self, gm: fx.GraphModule, tp: int, param_names: Set[str], sequence_parallel=False):
        self.gm, self.tp, self.param_names, self.sp = gm, tp, param_names, sequence_parallel
        self.force_gather: Set[Tuple[fx.Node, fx.Node]] = set()
        self.demoted: Dict[fx.Node, str] = {}
        self.forced_rep: Dict[str, str] = {}
        self.blocks_req: Dict[fx.Node, Tuple[int, ...]] = {}
        # which values depend on the batch, which on parameters (need gradients)
        self.from_input: Set[fx.Node] = set()
        self.needs_grad: Set[fx.Node] = set()
        for n in gm.graph.nodes:
            ins = n.all_input_nodes
            if n.op == "placeholder" or any(a in self.from_input for a in ins):
                self.from_input.add(n)
            if n.op == "get_attr" and n.target in param_names:
                self.needs_grad.add(n)
            elif (n.op == "call_function" and packet(n) not in _NO_GRAD
                  and not (n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not n.args[0])
                  and any(a in self.needs_grad for a in ins)):
                self.needs_grad.add(n)

    # ---- the loop ------------------------------------------------------------
    def reset(self):
        self.plan = TPPlan(self.tp, sequence_parallel=self.sp)
        self.plc: Dict[fx.Node, object] = self.plan.node_plc
        self.pending_bias: Dict[fx.Node, fx.Node] = {}
        self.free: Dict[fx.Node, Tuple[str, Tuple[int, ...]]] = {}
        self.origin: Dict[fx.Node, frozenset] = {}
        self.claims: Dict[str, str] = {}

    def run(self) -> TPPlan:
        attempts = walk(self.gm.graph, self)
        self.plan.attempts = attempts
        self.plan.replicated_params = dict(self.forced_rep)
        for n, why in self.demoted.items():
            d = self.plan.decisions.get(n)
            if d is not None and d.kind == "replicated" and not d.reason:
                d.reason = why
        return self.plan

    def decide(self, node: fx.Node) -> Outcome:
        """The outcome of ``node``: structural nodes here, calls through the rule table."""
        view = View(self, node)
        if node.op == "get_attr" and node.target in self.param_names:
            view.alias(node.target, tuple(range(val(node).ndim)))
            return view.set_rule("parameter")
        try:
            if node.op == "placeholder":
                view.set(node, R, rule="input")
            elif node.op == "get_attr":
                view.set(node, R, rule="constant")
            elif node.op == "output":
                for a in node.all_input_nodes:
                    view.replicate(a, node)
            elif node.op == "call_function":
                view.forced_gathers()
                fn = rule_for(node)
                out = fn(view, node)
                if out is not view.outcome:
                    raise RuntimeError(f"internal: rule {fn.rule_name} returned {out!r} for {where(node)}, "
                                       "not its outcome")
                if out.rule is None:
                    out.rule = fn.rule_name
            else:
                for a in node.all_input_nodes:
                    view.replicate(a, node)
                view.set(node, R, rule=f"opaque: a {node.op} node")
        except Stop:
            pass
        return view.outcome

    def record(self, node: fx.Node, out: Outcome):
        """Apply a rule's outcome: learn what it found and restart, or write the plan."""
        if out.learnt is not None:
            self.demoted.update(out.learnt.demoted)
            self.forced_rep.update(out.learnt.forced_rep)
            self.force_gather |= out.learnt.force_gather
            self.blocks_req.update(out.learnt.blocks)
            raise Restart
        plan = self.plan
        for pname, (plc, why) in out.claims.items():
            plan.param_plc[pname] = plc
            self.claims[pname] = why
        for change, value, consumer, dim in out.changes:
            plan.add(change, value, consumer, dim)
        for old, new, value, consumer in out.moves:
            plan.move(old, new, value, consumer)
        for a in out.bias_after:
            plan.bias_after[a] = self.pending_bias[a]
        if out.row_bias is not None:
            plan.row_bias.add(node)
            self.pending_bias[node] = out.row_bias
        if out.carried_bias is not None:
            self.pending_bias[node] = out.carried_bias
        if out.decision is not None:
            plan.decisions[node] = out.decision
        if out.arg_rewrite is not None:
            plan.arg_rewrites[node] = out.arg_rewrite
        for i, spec in out.head_slices.items():
            plan.head_slices[(node, i)] = spec
        if out.alias is not None:
            self.free[node] = out.alias
        if out.placement is not UNSET:
            self.plc[node] = out.placement
            if out.origins:
                self.origin[node] = out.origins
        if out.rule is not None:
            plan.rules[node] = out.rule


def plan_tensor_parallel(gm: fx.GraphModule, tp: int, param_names, sequence_parallel: bool = False) -> TPPlan:
    """Placements for every node and a decision for every matmul, embedding and loss."""
    return State(gm, tp, set(param_names), sequence_parallel).run()
