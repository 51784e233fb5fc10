"""What a tensor-parallel rule reads (``View``) and what it returns (``Outcome``).

A rule is ``rule(view, node) -> Outcome`` (docs/ENGINE.md, step 3). The view reads the
walk's ``State`` (the placements of earlier nodes, the parameters' claims, what earlier
attempts learnt) and never writes it. What the rule decides goes into the view's outcome:
the changes of placement at its inputs (rows of ``plan.CHANGES``), the parameters it
claims, a decision, the arguments it rewrites, the node's placement. Reads through the
view see the rule's own earlier decisions (a partial sum it asked reduced reads as whole,
a parameter it claimed reads as claimed), as they would once recorded.

A rule that finds a split it cannot carry ends with ``view.demote`` (or ``view.blocks``,
or a claim that conflicts with an earlier one): the outcome then holds what the attempt
learnt, and ``Stop`` ends the rule. ``State.record`` applies an outcome: learns and
restarts, or writes the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import val, where
from fxmegatron.passes.tensor_parallel.plan import G, GATHER, GATHER_INTO_COLUMN, SCATTER, SPLIT, Decision
from fxmegatron.passes.tensor_parallel.sequence import SEQ, forced_gathers, gather, gather_instead_of_demote
from fxmegatron.placement import Partial, Placement, R, Replicate, Shard

if TYPE_CHECKING:
    from fxmegatron.passes.tensor_parallel.propagate import State

UNSET = object()     # an outcome that places nothing (a free parameter's alias)


class Stop(Exception):
    """A rule's outcome ends its attempt (it learnt a constraint); the walk restarts."""


@dataclass
class Learnt:
    """What an attempt learnt, kept by the next: matmuls demoted to replicated, parameters
    forced replicated, sequence shards to gather where they enter a node, fused blocks a
    column matmul must lay its output out in."""
    demoted: Dict[fx.Node, str] = field(default_factory=dict)
    forced_rep: Dict[str, str] = field(default_factory=dict)
    force_gather: Set[Tuple[fx.Node, fx.Node]] = field(default_factory=set)
    blocks: Dict[fx.Node, Tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Outcome:
    """A rule's answer for the node it was asked about."""
    placement: object = UNSET
    origins: frozenset = frozenset()
    rule: Optional[str] = None
    # (change, value, consumer, dim), in the order asked; then (old, new, value, consumer)
    changes: List[tuple] = field(default_factory=list)
    moves: List[tuple] = field(default_factory=list)
    claims: Dict[str, Tuple[Placement, str]] = field(default_factory=dict)   # new claims only
    decision: Optional[Decision] = None
    row_bias: Optional[fx.Node] = None        # added after this node's partial sum is reduced
    carried_bias: Optional[fx.Node] = None    # a deferred bias this node carries on
    bias_after: List[fx.Node] = field(default_factory=list)   # values whose bias follows their g
    arg_rewrite: Optional[tuple] = None
    head_slices: Dict[int, tuple] = field(default_factory=dict)
    alias: Optional[Tuple[str, Tuple[int, ...]]] = None       # a free parameter's new dim map
    learnt: Optional[Learnt] = None


class View:
    """The state as the rule of ``node`` sees it (read only), and its outcome."""

    def __init__(self, state: "State", node: fx.Node):
        self._s, self.node = state, node
        self.outcome = Outcome()
        self.tp, self.sp = state.tp, state.sp
        # read-only to rules
        self.free, self.needs_grad, self.from_input = state.free, state.needs_grad, state.from_input
        self.forced_rep, self.demoted, self.blocks_req = state.forced_rep, state.demoted, state.blocks_req
        self.force_gather, self.pending_bias = state.force_gather, state.pending_bias

    def forced_gathers(self) -> None:
        """The gathers an earlier attempt asked for at the visited node's inputs."""
        forced_gathers(self, self.node)

    # ---- reads ---------------------------------------------------------------
    def _pending(self, change, value, consumer):
        return any(c == change and v is value and k is consumer for c, v, k, _ in self.outcome.changes)

    def sees(self, change, value, consumer) -> bool:
        """Whether ``consumer`` reads ``value`` through ``change`` (recorded or asked here)."""
        moves = self.outcome.moves
        if any(n == change and v is value and k is consumer for _, n, v, k in moves):
            return True
        if any(o == change and v is value and k is consumer for o, _, v, k in moves):
            return False
        return self._s.plan.sees(change, value, consumer) or self._pending(change, value, consumer)

    def dim_of(self, change, value):
        d = self._s.plan.dim_of(change, value)
        if not self._s.plan.has(change, value):
            d = next((dim for c, v, _, dim in self.outcome.changes if c == change and v is value), None)
        return d

    def seq_edge_dim(self, a, consumer):
        """The dim of a sequence shard that ``consumer`` sees where ``a`` enters it through a
        reduce-scatter or a split; None when it enters otherwise."""
        for change in (SCATTER, SPLIT):
            if self.sees(change, a, consumer):
                return self.dim_of(change, a)
        return None

    def get(self, n):
        """Placement of ``n`` as the visited node sees it (after g / scatter / gather)."""
        c = self.node
        if isinstance(n, fx.Node):
            if any(self.sees(change, n, c) for change in (G, GATHER_INTO_COLUMN, GATHER)):
                return R
            d = self.seq_edge_dim(n, c)
            if d is not None:
                return Shard(d)
        return self.base(n)

    def orig(self, n):
        """The column matmuls a split came from, or SEQ for a sequence shard."""
        if self.seq_edge_dim(n, self.node) is not None:
            return frozenset([SEQ])
        return self._s.origin.get(n, frozenset())

    def base(self, n):
        """Placement of ``n`` itself (None: a parameter no rule has claimed yet)."""
        if n in self.free:
            pname, dmap = self.free[n]
            pp = self._param(pname)
            if pp is None:
                return None
            if isinstance(pp, Shard):
                # a dim the alias does not keep (rows gathered by an index): not its layout to
                # carry, so it reads as unclaimed and its consumer's claim conflicts (replicated)
                return Shard(dmap.index(pp.dim), pp.blocks) if pp.dim in dmap else None
            return pp
        return self._s.plc.get(n, R)

    def _param(self, pname):
        mine = self.outcome.claims.get(pname)
        return mine[0] if mine is not None else self._s.plan.param_plc.get(pname)

    def shard_inputs(self, node):
        """(input, placement) of the inputs of ``node`` that are split."""
        return [(a, p) for a in node.all_input_nodes for p in [self.get(a)] if isinstance(p, Shard)]

    # ---- the outcome ---------------------------------------------------------
    def set(self, node, plc, origins=frozenset(), rule: Optional[str] = None) -> Outcome:
        """Place the visited node; ``rule`` names the rule (default: the table's name)."""
        out = self.outcome
        out.placement, out.origins = plc, frozenset(origins)
        if rule is not None:
            out.rule = rule
        return out

    def set_rule(self, rule: str) -> Outcome:
        self.outcome.rule = rule
        return self.outcome

    def add(self, change, value, consumer, dim=None) -> None:
        """``consumer`` reads ``value`` through ``change`` (one of ``plan.CHANGES``)."""
        self.outcome.changes.append((change, value, consumer, dim))

    def move(self, old, new, value, consumer) -> None:
        """``consumer`` reads ``value`` through ``new`` instead of ``old``."""
        self.outcome.moves.append((old, new, value, consumer))

    def decide(self, decision: Decision) -> None:
        self.outcome.decision = decision

    def rewrite_args(self, args: tuple) -> None:
        self.outcome.arg_rewrite = args

    def slice_heads(self, i: int, spec: tuple) -> None:
        self.outcome.head_slices[i] = spec

    def defer_bias(self, bias: fx.Node) -> None:
        """The visited node is a row-parallel matmul: its bias is added after the reduction."""
        self.outcome.row_bias = bias

    def alias(self, pname: str, dmap: Tuple[int, ...]) -> Outcome:
        """The visited node is the free parameter ``pname`` with its dims reordered."""
        self.outcome.alias = (pname, dmap)
        return self.outcome

    def claim(self, n, want: Placement, why: str) -> bool:
        """Ask that a parameter-derived value be laid out as ``want``; a claim conflicting
        with an earlier one forces the parameter replicated (stop)."""
        if n not in self.free:
            return self.get(n) == want
        pname, dmap = self.free[n]
        if isinstance(want, Shard) and dmap[want.dim] is None:
            return False        # a dim the alias added or gathered: no dim of the parameter to split
        pw = Shard(dmap[want.dim], want.blocks) if isinstance(want, Shard) else R
        if pname in self.forced_rep:
            return isinstance(pw, Replicate)
        cur = self._param(pname)
        if cur is None:
            self.outcome.claims[pname] = (pw, why)
            return True
        if cur == pw:
            return True
        self.stop(forced_rep={pname: f"parameter {pname} is needed as {cur} by {self._claimed_by(pname)} "
                                     f"and as {pw} by {why}"})

    def _claimed_by(self, pname):
        mine = self.outcome.claims.get(pname)
        return mine[1] if mine is not None else self._s.claims[pname]

    def replicate(self, a, consumer) -> None:
        """``consumer`` needs ``a`` whole: reduce a partial sum (g) or fail on a shard."""
        p = self.get(a)
        if isinstance(p, Partial):
            self.add(G, a, consumer)
            self.bias_after_reduction_of(a)
        elif isinstance(p, Shard) and SEQ in self.orig(a):
            gather(self, a, consumer)
        elif isinstance(p, Shard):
            self.demote(self.orig(a), consumer, f"needs its input {a.name} whole")
        elif p is None:
            self.claim(a, R, where(consumer))

    def bias_after_reduction_of(self, a) -> None:
        """The deferred row-parallel bias of ``a`` (if any) is added after its reduction."""
        if a in self.pending_bias:
            self.outcome.bias_after.append(a)

    def carry_bias(self, x, node) -> bool:
        """A deferred row-parallel bias rides along views that keep the last dim; False
        (and ``x`` reduced) where it cannot."""
        if x in self.pending_bias:
            if val(node).shape[-1] == val(x).shape[-1]:
                self.outcome.carried_bias = self.pending_bias[x]
            else:
                self.replicate(x, node)
                return False
        return True

    # ---- ends of an attempt --------------------------------------------------
    def stop(self, **learnt):
        """End the attempt, having learnt ``learnt`` (``Learnt``'s fields)."""
        self.outcome.learnt = Learnt(**learnt)
        raise Stop

    def demote(self, origins, node, why):
        """``node`` cannot carry a split that came from ``origins``: those column matmuls
        become replicated (a sequence shard is gathered where it enters ``node`` instead).
        Always stops."""
        origins = gather_instead_of_demote(self, origins, node)
        origins -= set(self.demoted)
        if origins:
            self.stop(demoted={m: f"its output reaches {where(node)}, which {why}" for m in origins})
        # no matmul to demote: the split is a parameter's, claimed by an earlier use (a
        # per-head weight also used whole); that parameter stays replicated instead
        params = self._split_params(node) - set(self.forced_rep)
        if not params:
            raise RuntimeError(f"internal: conflict at {where(node)} with no matmul to demote: {why}")
        self.stop(forced_rep={p: f"parameter {p}, split by {self._claimed_by(p)}, reaches {where(node)}, "
                                 f"which {why}" for p in params})

    def blocks(self, matmuls, sizes: Tuple[int, ...]):
        """Ask the column matmuls ``matmuls`` to lay their output out in fused blocks of
        ``sizes`` (stops)."""
        self.stop(blocks={m: sizes for m in matmuls})

    def _split_params(self, node):
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
            elif not self._s.origin.get(a):
                todo.extend(b for b in a.all_input_nodes if isinstance(self.base(b), Shard))
        return found
