"""A loss term of batch statistics (an MoE router's load-balancing loss) computed over the whole
data-parallel batch, so that dp (and expert parallelism, which folds onto it) is exact with it.

The unmodified model adds to its mean cross-entropy a term computed once from statistics of every
token of the batch: the fraction of tokens each expert was given and its mean router probability
(Switch Transformer's loss, as transformers' ``load_balancing_loss_func`` computes it). Under dp a
replica holds a piece of the batch, and the term of a piece's statistics is not the batch's, nor
are the pieces' terms additive (``passes.loss_terms``). Here every replica computes the batch's
term from the batch's statistics: each statistic (a sum over the piece's tokens) is all-reduced
over dp, then the term is the same number on every replica.

Recognised (``recognise``), every precondition checked, from the ops (no model's names):

* N is the number of tokens of the piece: the elements of the cross-entropy's target; a dim of
  size N is the token dim (as ``expert_parallel.region`` reads sizes), and a tensor with two
  dims of that size is not read as one;
* a *statistic* is a sum over the piece's N tokens: a sum over dim 0 of an ``[N, ...]`` tensor, a
  sum of all elements of an ``[N]`` tensor, a histogram (``histc``) or a ``scatter_add`` into
  fresh zeros over ``N·k`` elements (k per token: the top-k picks); sums of statistics (the
  layers' accumulated), a statistic plus zero, and casts are statistics too;
* a statistic reaches the rest of the term only divided by a number equal to its token count (k
  or 1 elements a token, over as many layers as it sums: a mean), or divided by another
  statistic (a ratio of sums); a mean over dim 0 of an ``[N, ...]`` tensor or of all of an
  ``[N]`` one (a z-loss's) is a statistic divided by its count already;
* no other node of the term reads a value of the piece (one with a token dim, or computed from
  one other than through a statistic). A term of the weights alone (a regulariser) has no
  statistic: it is the same on every replica.

Rewritten (``over_dp``): each statistic is all-reduced over dp, forward and backward (Megatron's
g then f: each replica's term is the batch's, and the backward's all-reduce hands each replica the
sum over the replicas' identical upstream gradients, i.e. dp times its own tokens' part, which the
gradient sync's division by dp makes its share); a mean's count is multiplied by dp. The
cross-entropy becomes its sum over the piece's counted labels × dp / the batch's counted labels
(all-reduced), so the replica's loss is weighted in the graph (``gm.meta[WEIGHTED]``: the runtime
weighs it by one) and the mean over the replicas of ``cross-entropy + term`` is the unmodified
model's loss. Preconditions: one microbatch, no pipeline or context parallelism (the statistics
of later microbatches, stages or sequence chunks are not there when the term is computed); local
shapes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.errors import LossError
from fxmegatron.ops.collectives import copy_to_tp, reduce_from_tp
from fxmegatron.passes.loss_terms import cross_entropy_and_term, place
from fxmegatron.passes.tensor_parallel.nodes import packet, val

aten = torch.ops.aten
WEIGHTED = "fxmegatron/loss_weighted_in_graph"     # gm.meta: the graph's loss is its replica's share

_CASTS = frozenset({aten.to, aten._to_copy})
_ADDS = frozenset({aten.add, aten.add_})
_DIVS = frozenset({aten.div, aten.div_})
_ZEROS = frozenset({aten.zeros, aten.zeros_like, aten.new_zeros})


@dataclass(frozen=True)
class Stat:
    """A sum over tokens: ``tokens`` summed (N a layer), ``per_token`` elements each."""
    tokens: int
    per_token: int


@dataclass
class Plan:
    """What ``over_dp`` rewrites: the cross-entropy, the statistics (all-reduced) and the divisions
    by a count and the means over tokens (their counts times dp)."""
    cross_entropy: fx.Node
    stats: Dict[fx.Node, Stat] = field(default_factory=dict)
    means: list = field(default_factory=list)          # div(stat, count) nodes
    ratios: list = field(default_factory=list)         # div(stat, stat) nodes
    token_means: list = field(default_factory=list)    # mean over dim 0 of [N, ...]


def _numel(n) -> Optional[int]:
    v = val(n)
    return v.numel() if isinstance(v, torch.Tensor) else None


def _shape(n) -> Tuple[int, ...]:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _dims(n, i, name) -> Optional[list]:
    d = n.args[i] if len(n.args) > i else n.kwargs.get(name)
    return list(d) if isinstance(d, (list, tuple)) else d


def _token_sum(n: fx.Node, N: int) -> Optional[Stat]:
    """The statistic ``n`` makes of a token-side input, or None."""
    p, x = packet(n), n.args[0] if n.args else None
    if not isinstance(x, fx.Node):
        return None
    if p is aten.sum and n.target is aten.sum.dim_IntList and _dims(n, 1, "dim") in ([0], [-len(_shape(x))]) \
            and _shape(x)[:1] == (N,) and len(_shape(x)) == 2 and _shape(x)[1] != N:    # which dim is unambiguous
        return Stat(N, 1)
    if n.target is aten.sum.default and _shape(x) == (N,):
        return Stat(N, 1)
    if p is aten.histc and _numel(x) and _numel(x) % N == 0:
        return Stat(N, _numel(x) // N)
    if p in (aten.scatter_add, aten.scatter_add_) and len(n.args) >= 4 and n.args[1] == 0 \
            and isinstance(n.args[0], fx.Node) and packet(n.args[0]) in _ZEROS and not n.args[0].all_input_nodes \
            and _numel(n.args[3]) and _numel(n.args[3]) % N == 0 and _numel(n.args[2]) == _numel(n.args[3]):
        return Stat(N, _numel(n.args[3]) // N)
    return None


def _token_mean(n: fx.Node, N: int) -> bool:
    """A mean over the tokens: over dim 0 of an ``[N, ...]`` tensor, or of all of an ``[N]`` one."""
    x = n.args[0] if n.args else None
    if n.target is aten.mean.dim and _dims(n, 1, "dim") in ([0], [-len(_shape(x))]):
        return _shape(x)[:1] == (N,) and N not in _shape(x)[1:]
    return n.target is aten.mean.default and _shape(x) == (N,)


def recognise(gm: fx.GraphModule) -> Tuple[Optional[Plan], str]:
    """(the plan, "") when the graph's loss is a mean cross-entropy plus a term of batch
    statistics (the module's doc), else (None, why not, naming the node)."""
    found = cross_entropy_and_term(gm)
    if found is None:
        return None, "the loss is not a cross-entropy plus a term"
    ce, term = found
    target = ce.args[1] if len(ce.args) > 1 else None
    N = _numel(target)
    if not N:
        return None, f"the cross-entropy {ce.name}'s target has no known size"
    plan = Plan(ce)
    kind: Dict[fx.Node, object] = {}       # "token", "const", "batch" or a Stat (a raw statistic)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    need, stack = set(), [term]
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    for n in sorted(need, key=order.__getitem__):
        ins = n.all_input_nodes
        kinds = [kind[a] for a in ins]
        raw = [k for k in kinds if isinstance(k, Stat)]
        if n.op == "placeholder":
            kind[n] = "token"
        elif n.op == "get_attr":
            kind[n] = "const"       # a parameter: the same on every replica
        elif not ins:
            kind[n] = "const"
        elif "token" in kinds:
            s = _token_sum(n, N)
            if s is None and _token_mean(n, N):
                plan.token_means.append(n)
                kind[n] = "batch"
            elif s is not None and not raw:
                kind[n] = s
            else:
                kind[n] = "token"
        elif raw:
            other = [a for a in n.args if not (isinstance(a, fx.Node) and isinstance(kind[a], Stat))]
            if packet(n) in _CASTS and len(raw) == 1:
                kind[n] = raw[0]
            elif packet(n) in _ADDS and len(raw) == 2 and raw[0].per_token == raw[1].per_token:
                kind[n] = Stat(raw[0].tokens + raw[1].tokens, raw[0].per_token)
            elif packet(n) in _ADDS and len(raw) == 1 and len(n.args) == 2 and (
                    other[0] == 0 or (isinstance(other[0], fx.Node) and kind[other[0]] == "const"
                                      and packet(other[0]) in _ZEROS)):
                kind[n] = raw[0]
            elif packet(n) in _DIVS and len(raw) == 1 and isinstance(kind.get(n.args[0]), Stat) \
                    and isinstance(n.args[1], (int, float)) \
                    and n.args[1] in (raw[0].tokens, raw[0].tokens * raw[0].per_token):
                plan.means.append(n)
                kind[n] = "batch"
            elif packet(n) in _DIVS and len(raw) == 2 and all(isinstance(kind.get(a), Stat) for a in n.args[:2]):
                plan.ratios.append(n)
                kind[n] = "batch"
            else:   # a sum used otherwise (the experts' grouping counts): a value of this piece only
                kind[n] = "token"
        else:
            kind[n] = "batch"
        if isinstance(kind[n], Stat) and n not in plan.stats:
            plan.stats[n] = kind[n]
    if kind[term] == "token" or isinstance(kind[term], Stat):     # a sum over tokens added as it is, too
        culprit = next((n for n in sorted(need, key=order.__getitem__) if kind[n] == "token"
                        and any(kind.get(u) not in ("token", None) or u is term for u in n.users)), term)
        return None, (f"the term {term.name} reads a value of this piece of the batch at {place(culprit)}, not "
                      "only sums over its tokens each divided by its count of tokens or by another such sum (whose "
                      "batch values are the replicas' sums)")
    # the statistics rewritten: the ones a division or a cast reads at the boundary
    plan.stats = {n: s for n, s in plan.stats.items() if any(n in (d.args[0], d.args[1] if len(d.args) > 1 else None)
                                                            for d in plan.means + plan.ratios)}
    return plan, ""     # no statistic: a term of the weights alone, the same on every replica


def applies(lay) -> bool:
    """Whether Layout ``lay`` (its degrees set) is one this pass makes exact: the batch split over dp
    only (one microbatch, no pipeline, no cp), and dp's group is every replica (no hybrid sharding's
    replica groups)."""
    return lay.dp > 1 and lay.microbatches == 1 and not lay.pipelined() and lay.cp == 1 and lay.dp_replicate == 1


def verified_together(gm: fx.GraphModule, lay) -> bool:
    """Whether ``verify`` of Layout ``lay`` runs this pass (its replicas must then run at once)."""
    return applies(lay) and recognise(gm)[0] is not None


def split_term(applied: bool):
    """``loss_terms.check_split_loss``'s ``term``: whether a layout (``applied``: see ``applies``)
    computes the graph's added term exactly, else what the refusal adds."""
    def check(gm: fx.GraphModule) -> Tuple[bool, str]:
        plan, why = recognise(gm)
        if plan is not None and applied:
            return True, ""
        return False, ("; fxmegatron computes such a term over the data-parallel batch with dp alone (one microbatch, "
                       f"no pp, cp or dp_replicate), {'not with this layout' if plan is not None else 'but not this one: ' + why}")
    return check


def over_dp(gm: fx.GraphModule, dp: int, group_name: str) -> fx.GraphModule:
    """The rewrite of the module's doc, on a graph ``recognise`` accepts (else a LossError)."""
    if cross_entropy_and_term(gm) is None:
        return gm
    plan, why = recognise(gm)
    if plan is None:
        raise LossError(f"the loss's added term cannot be computed over the data-parallel batch: {why}")
    g = gm.graph
    whole = {}
    for s in plan.stats:
        whole[s] = _after(g, s, (reduce_from_tp, (s, group_name)), (copy_to_tp, ("@", group_name)))
    for d in plan.ratios:
        d.args = (whole[d.args[0]], whole[d.args[1]], *d.args[2:])
    for d in plan.means:
        d.args = (whole[d.args[0]], d.args[1] * dp, *d.args[2:])
    for m in plan.token_means:
        users = list(m.users)
        avg = _after(g, m, (reduce_from_tp, (m, group_name)), (copy_to_tp, ("@", group_name)),
                     (aten.div.Tensor, ("@", dp)))
        for u in users:
            u.replace_input_with(m, avg)
    _weigh_cross_entropy(g, plan.cross_entropy, dp, group_name)
    g.lint()
    gm.recompile()
    gm.meta[WEIGHTED] = True
    return gm


def _weigh_cross_entropy(g: fx.Graph, ce: fx.Node, dp: int, group_name: str) -> None:
    """The mean cross-entropy made this replica's share of the batch's: its sum × dp / the batch's
    counted labels."""
    from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
    # (index, name, default) of the reduction and the ignored label in each op's schema
    (r_at, r_name, r_def), (i_at, i_name, i_def) = (
        ((4, "reduction", 1), (5, "ignore_index", -100)) if ce.target is vocab_parallel_cross_entropy
        else ((3, "reduction", 1), (4, "ignore_index", -100)))
    ignore = ce.args[i_at] if len(ce.args) > i_at else ce.kwargs.get(i_name, i_def)
    target = ce.args[1]
    if len(ce.args) > r_at:
        ce.args = ce.args[:r_at] + (2,) + ce.args[r_at + 1:]     # 2: the sum
    else:
        ce.kwargs = {**ce.kwargs, r_name: 2}
    users = list(ce.users)
    with g.inserting_after(ce):
        counted = g.call_function(aten.ne.Scalar, (target, ignore))
    with g.inserting_after(counted):
        count = g.call_function(aten.sum.default, (counted,), {"dtype": torch.float32})
    total = _after(g, count, (reduce_from_tp, (count, group_name)))
    share = _after(g, total, (aten.mul.Tensor, (ce, float(dp))), (aten.div.Tensor, ("@", total)))
    for u in users:
        u.replace_input_with(ce, share)


def _after(g: fx.Graph, at: fx.Node, *calls) -> fx.Node:
    """The calls inserted in order after ``at``, each ``"@"`` among its args the one before; the last."""
    for fn, args in calls:
        with g.inserting_after(at):
            at = g.call_function(fn, tuple(at if a == "@" else a for a in args))
    return at
