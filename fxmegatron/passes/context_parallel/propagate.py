"""The walk that places every node for context parallelism, and what it records.

Every value starts where its inputs are. The batch's inputs are whole, their sequence dim
known (dim 1 of a [B, S, ...] input). Values computed from them and from constants alone
(positions, shifted labels, rotary tables) stay whole on every rank: cheap, and exact. The
first op that also reads a value with a gradient (an embedding's weight) takes this
rank's chunks of its whole sequence inputs (``take``), and from there on activations hold
the rank's chunks only. A whole value that meets a split one later (a position table added
to token embeddings, labels at the loss) is taken there too, aligned by broadcasting.

A rule (``rules.py``) that cannot run an op on chunks raises ``ShardingError`` naming the
node, its module path and why: context parallelism never guesses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Sequence, Set, Tuple

import torch
import torch.fx as fx

from fxmegatron.errors import ShardingError
from fxmegatron.passes.context_parallel import rules, rules_compute
from fxmegatron.passes.context_parallel.experts import expert_blocks, experts_rule
from fxmegatron.passes.context_parallel.layout import is_split, seq, seq_of
from fxmegatron.passes.context_parallel.registry import Outcome, rule_for
from fxmegatron.passes.redistribute import Edge
from fxmegatron.passes.tensor_parallel.nodes import packet, val, where
from fxmegatron.passes.walk import walk
from fxmegatron.placement import P, Placement, R

aten = torch.ops.aten
RULE_MODULES = (rules, rules_compute)      # importing them fills the table
_NO_GRAD = {aten.detach, aten.lift_fresh_copy}


@dataclass
class CPPlan:
    cp: int
    seq: int
    plc: Dict[fx.Node, object] = field(default_factory=dict)
    rules: Dict[fx.Node, str] = field(default_factory=dict)
    takes: Dict[Tuple[fx.Node, fx.Node], Placement] = field(default_factory=dict)   # (value, consumer) -> chunks
    sums: Set[Tuple[fx.Node, fx.Node]] = field(default_factory=set)        # partial value made whole for consumer
    sizes: Dict[fx.Node, Tuple[int, int]] = field(default_factory=dict)    # view/expand: (arg index, dim)
    attention: List[fx.Node] = field(default_factory=list)
    mean_losses: Dict[fx.Node, int] = field(default_factory=dict)          # loss -> ignore_index
    mean_divisor: Dict[fx.Node, int] = field(default_factory=dict)         # mean over the sequence -> /cp
    token_sizes: Set[fx.Node] = field(default_factory=set)     # in an experts block: its token count /cp
    experts: Set[fx.Node] = field(default_factory=set)         # inside an experts block: no placement

    def edges(self) -> Iterator[Edge]:
        """The takes (one per value, dim and inner, its consumers in graph order) then the sums
        (a value's consumers by name), as changes of placement on the cp axis."""
        takes: Dict[tuple, List[fx.Node]] = {}
        for (a, consumer), s in self.takes.items():
            takes.setdefault((a, *seq_of(s)), []).append(consumer)
        for (a, dim, inner), users in takes.items():
            yield Edge("cp", a, users, "R->S", "S->P", dim, inner)
        sums: Dict[fx.Node, List[fx.Node]] = {}
        for a, consumer in sorted(self.sums, key=lambda e: e[1].name):
            sums.setdefault(a, []).append(consumer)
        for a, users in sums.items():
            yield Edge("cp", a, users, "P->R", "R->R")


class View:
    """What a rule reads (and only that): placements so far (``get``), as the node being visited
    reads them (``placed``: after the walk's takes for it), whether a value is this rank's chunks
    (``split``), the sequence length ``seq`` and ``cp``; ``fail`` refuses, naming the node."""

    def __init__(self, state: "State"):
        self._state, self.seq, self.cp = state, state.plan.seq, state.plan.cp

    def get(self, n):
        return self._state.get(n)

    def placed(self, n):
        return self._state.placed(n)

    def split(self, n) -> bool:
        return is_split(self.get(n))

    def fail(self, node: fx.Node, why: str):
        self._state.fail(node, why)


class State:
    def __init__(self, gm: fx.GraphModule, cp: int, seq: int, param_names: Set[str], experts: Sequence = ()):
        self.gm = gm
        self.plan = CPPlan(cp, seq)
        self.view = View(self)
        self.blocks = expert_blocks(gm, experts)      # node -> its mixture-of-experts block
        self.needs_grad: Set[fx.Node] = set()
        for n in gm.graph.nodes:
            if n.op == "get_attr" and n.target in param_names:
                self.needs_grad.add(n)
            elif (n.op == "call_function" and packet(n) not in _NO_GRAD
                  and not (n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not n.args[0])
                  and any(a in self.needs_grad for a in n.all_input_nodes)):
                self.needs_grad.add(n)

    def get(self, n):
        return self.plan.plc.get(n, R) if isinstance(n, fx.Node) else R

    def set(self, node, plc, rule: str):
        self.plan.plc[node] = plc
        self.plan.rules[node] = rule

    def fail(self, node: fx.Node, why: str):
        exc = ShardingError(f"context parallelism cannot cut {where(node)}: it {why}")
        exc.node = node.name        # where it stopped, for a caller that can say more (lower.rank_passes)
        raise exc

    def split(self, n) -> bool:
        return is_split(self.get(n))

    def take(self, a: fx.Node, consumer: fx.Node, s: Placement):
        """``consumer`` reads this rank's chunks of the whole value ``a`` (its sequence where ``s``
        has it)."""
        self.plan.takes[(a, consumer)] = seq(*seq_of(s))

    def sum_for(self, a: fx.Node, consumer: fx.Node):
        """``consumer`` needs the partial value ``a`` whole: all-reduce over cp there."""
        self.plan.sums.add((a, consumer))

    def run(self) -> CPPlan:
        walk(self.gm.graph, self)
        return self.plan

    def reset(self):
        """Context parallelism learns nothing that changes earlier decisions: one attempt."""

    def decide(self, node: fx.Node) -> Outcome:
        """The outcome of ``node``: structural nodes here, calls through the rule table."""
        self.cur = node
        if node.op == "placeholder":
            v = val(node)
            known = isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == self.plan.seq
            return Outcome(seq(1, 1, split=False) if known else R, "input")
        if node.op == "get_attr":
            return Outcome(R, "parameter" if node in self.needs_grad else "constant")
        if node.op == "output":
            for a in node.all_input_nodes:
                if self.split(a):
                    self.fail(node, f"returns {a.name}, which holds this rank's chunks of the sequence "
                                    "(context parallelism trains to a loss)")
            return Outcome(None, "", sums=tuple(a for a in node.all_input_nodes if self.get(a) == P))
        if node.op != "call_function":
            if any(self.split(a) or self.get(a) == P for a in node.all_input_nodes):
                self.fail(node, f"is a {node.op} node")
            return Outcome(R, "opaque")
        if node in self.blocks:
            return experts_rule(self.view, node, self.blocks[node])
        ins = node.all_input_nodes
        split = any(self.split(a) for a in ins)
        partial = any(self.get(a) == P for a in ins)
        if not split and not partial:
            whole_seq = [a for a in ins if seq_of(self.get(a)) is not None]
            if whole_seq and any(a in self.needs_grad for a in ins):
                # compute starts here: the sequence inputs become this rank's chunks
                for a in whole_seq:
                    self.take(a, node, self.get(a))
                split = True
        return rule_for(node)(self.view, node, split)

    def record(self, node: fx.Node, out: Outcome):
        """The walk, not the rule, records what a rule decided (the output node has no placement)."""
        if out.placement is not None:
            self.set(node, out.placement, out.rule)
        elif out.rule == "experts":
            self.plan.experts.add(node)
        for a, s in out.takes:
            self.take(a, node, s)
        for a in out.sums:
            self.sum_for(a, node)
        if out.note is not None:
            kind, value = out.note
            if kind == "size":
                self.plan.sizes[node] = value
            elif kind == "mean_divisor":
                self.plan.mean_divisor[node] = value
            elif kind == "mean_loss":
                self.plan.mean_losses[node] = value
            elif kind == "attention":
                self.plan.attention.append(node)
            elif kind == "token_size":
                self.plan.token_sizes.add(node)
            else:
                raise ValueError(f"{node.name}: a rule's note {kind!r} is none the cp rewrite knows")

    def placed(self, a) -> object:
        """``a``'s placement as the node being visited reads it (after a take)."""
        t = self.plan.takes.get((a, self.cur))
        return t if t is not None else self.get(a)
