"""Placement propagation: the planning state, its helpers and the restart loop.

``State`` walks the ATen graph once per attempt and gives every tensor a placement
(Replicate / Shard(dim) / Partial) from the rule the table (``rules.rule_for``) has
for its op. A rule that finds a split it cannot carry *demotes* the column matmuls
the split came from (their origins) to replicated, records why and raises
``Restart``; propagation then starts again with what it learnt. The loop ends at a
fixed point: every attempt learns something new or finishes.

Parameters are *free* until a rule claims a layout for them (``claim``): a weight is
split the way its first matmul wants, and a parameter two rules want differently is
forced replicated (again with a restart).
"""
from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import packet, val, where
from fxmegatron.passes.tensor_parallel.plan import G, GATHER, GATHER_INTO_COLUMN, Restart, TPPlan
from fxmegatron.passes.tensor_parallel.rules import rule_for
from fxmegatron.passes.tensor_parallel.sequence import SEQ, forced_gathers, gather, gather_instead_of_demote, \
    seq_edge_dim
from fxmegatron.placement import Partial, Placement, R, Replicate, Shard

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
        self.cur: Optional[fx.Node] = None
        self.rule = ""
        self.pending_bias: Dict[fx.Node, fx.Node] = {}
        self.free: Dict[fx.Node, Tuple[str, Tuple[int, ...]]] = {}
        self.origin: Dict[fx.Node, frozenset] = {}
        self.claims: Dict[str, str] = {}

    def run(self) -> TPPlan:
        for attempt in range(1, 10_000):
            self.reset()
            try:
                for node in self.gm.graph.nodes:
                    self.visit(node)
            except Restart:
                continue
            self.plan.attempts = attempt
            self.plan.replicated_params = dict(self.forced_rep)
            for n, why in self.demoted.items():
                d = self.plan.decisions.get(n)
                if d is not None and d.kind == "replicated" and not d.reason:
                    d.reason = why
            return self.plan
        raise RuntimeError("tensor-parallel planning did not converge")

    def visit(self, node: fx.Node):
        """Place ``node``: structural nodes here, calls through the rule table."""
        self.cur = node
        if node.op == "placeholder":
            self.set(node, R, rule="input")
        elif node.op == "get_attr":
            if node.target in self.param_names:
                self.free[node] = (node.target, tuple(range(val(node).ndim)))
                self.plan.rules[node] = "parameter"
            else:
                self.set(node, R, rule="constant")
        elif node.op == "output":
            for a in node.all_input_nodes:
                self.replicate(a, node)
        elif node.op == "call_function":
            forced_gathers(self, node)
            fn = rule_for(node)
            self.rule = fn.rule_name
            fn(self, node)
            self.plan.rules.setdefault(node, self.rule)
        else:
            for a in node.all_input_nodes:
                self.replicate(a, node)
            self.set(node, R, rule=f"opaque: a {node.op} node")

    # ---- what a rule reads ---------------------------------------------------
    def get(self, n):
        """Placement of ``n`` as the node being visited sees it (after g / scatter / gather)."""
        c = self.cur
        if c is not None and isinstance(n, fx.Node):
            if any(self.plan.sees(change, n, c) for change in (G, GATHER_INTO_COLUMN, GATHER)):
                return R
            d = seq_edge_dim(self, n, c)
            if d is not None:
                return Shard(d)
        return self.base(n)

    def orig(self, n):
        """The column matmuls a split came from, or SEQ for a sequence shard."""
        c = self.cur
        if c is not None and seq_edge_dim(self, n, c) is not None:
            return frozenset([SEQ])
        return self.origin.get(n, frozenset())

    def base(self, n):
        """Placement of ``n`` itself (None: a parameter no rule has claimed yet)."""
        if n in self.free:
            pname, dmap = self.free[n]
            pp = self.plan.param_plc.get(pname)
            if pp is None:
                return None
            if isinstance(pp, Shard):
                return Shard(dmap.index(pp.dim), pp.blocks)
            return pp
        return self.plc.get(n, R)

    def shard_inputs(self, node):
        """(input, placement) of the inputs of ``node`` that are split."""
        return [(a, p) for a in node.all_input_nodes for p in [self.get(a)] if isinstance(p, Shard)]

    # ---- what a rule writes --------------------------------------------------
    def set(self, node, plc, origins=frozenset(), rule: Optional[str] = None):
        """Place the visited node; ``rule`` names the rule (default: the table's name)."""
        self.plc[node] = plc
        if origins:
            self.origin[node] = frozenset(origins)
        if rule is not None:
            self.plan.rules[node] = rule

    def claim(self, n, want: Placement, why: str) -> bool:
        """Ask that a parameter-derived value be laid out as ``want``."""
        if n not in self.free:
            return self.get(n) == want
        pname, dmap = self.free[n]
        if isinstance(want, Shard):
            pw = Shard(dmap[want.dim], want.blocks)
        else:
            pw = R
        if pname in self.forced_rep:
            return isinstance(pw, Replicate)
        cur = self.plan.param_plc.get(pname)
        if cur is None:
            self.plan.param_plc[pname] = pw
            self.claims[pname] = why
            return True
        if cur == pw:
            return True
        self.forced_rep[pname] = (f"parameter {pname} is needed as {cur} by {self.claims[pname]} "
                                  f"and as {pw} by {why}")
        raise Restart

    def demote(self, origins, node, why):
        """``node`` cannot carry a split that came from ``origins``: those column matmuls
        become replicated (a sequence shard is gathered instead). Always restarts."""
        origins = gather_instead_of_demote(self, origins, node) - set(self.demoted)
        if not origins:
            # no matmul to demote: the split is a parameter's, claimed by an earlier use (a
            # per-head weight also used whole); that parameter stays replicated instead
            params = self.split_params(node) - set(self.forced_rep)
            if not params:
                raise RuntimeError(f"internal: conflict at {where(node)} with no matmul to demote: {why}")
            for pname in params:
                self.forced_rep[pname] = (f"parameter {pname}, split by {self.claims[pname]}, reaches "
                                          f"{where(node)}, which {why}")
            raise Restart
        for m in origins:
            self.demoted[m] = f"its output reaches {where(node)}, which {why}"
        raise Restart

    def split_params(self, node):
        """Names of the split parameters whose shards reach ``node`` through ops that made
        no split of their own (casts, elementwise ops of the parameter alone)."""
        found, seen = set(), set()
        todo = [a for a, _ in self.shard_inputs(node)]
        while todo:
            a = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            if a in self.free:
                found.add(self.free[a][0])
            elif not self.origin.get(a):
                todo.extend(b for b in a.all_input_nodes if isinstance(self.base(b), Shard))
        return found

    def replicate(self, a, consumer):
        """``consumer`` needs ``a`` whole: reduce a partial sum (g) or fail on a shard."""
        p = self.get(a)
        if isinstance(p, Partial):
            self.plan.add(G, a, consumer)
            if a in self.pending_bias:
                self.plan.bias_after[a] = self.pending_bias[a]
        elif isinstance(p, Shard) and SEQ in self.orig(a):
            gather(self, a, consumer)
        elif isinstance(p, Shard):
            self.demote(self.orig(a), consumer, f"needs its input {a.name} whole")
        elif p is None:
            self.claim(a, R, where(consumer))

    def carry_bias(self, x, node) -> bool:
        """A deferred row-parallel bias rides along views that keep the last dim; False
        (and ``x`` reduced) where it cannot."""
        if x in self.pending_bias:
            if val(node).shape[-1] == val(x).shape[-1]:
                self.pending_bias[node] = self.pending_bias[x]
            else:
                self.replicate(x, node)
                return False
        return True


def plan_tensor_parallel(gm: fx.GraphModule, tp: int, param_names, sequence_parallel: bool = False) -> TPPlan:
    """Placements for every node and a decision for every matmul, embedding and loss."""
    return State(gm, tp, set(param_names), sequence_parallel).run()
