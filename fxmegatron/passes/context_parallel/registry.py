"""The context-parallel rule table (op packet -> rule), what a rule returns (``Outcome``) and what
every rule shares. The rule modules (``rules``, ``rules_compute``) fill the table when imported.

A rule is a pure function ``rule(view, node, split) -> Outcome``: it reads placements through
``view`` (``propagate.View``: ``get``, ``placed``, ``split``, ``seq``, ``cp``) and returns the
node's placement and the changes of placement it needs at its inputs; it records nothing. The
walk (``propagate.State``) records the outcome. A rule that cannot run an op on chunks raises
``ShardingError`` through ``view.fail``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.passes.context_parallel.layout import seq, seq_of
from fxmegatron.passes.tensor_parallel.nodes import packet, val
from fxmegatron.placement import P, R

aten = torch.ops.aten
RULES: Dict[object, Callable] = {}


@dataclass(frozen=True)
class Outcome:
    """What a rule decides for one node.

    ``placement``: the output's (a tuple for an op of several outputs). ``takes``: inputs this
    node reads as this rank's chunks, ``(input, its sequence placement)`` (R->S, ``cp_take``).
    ``sums``: partial inputs it needs whole (P->R, ``cp_sum``). ``note``: what the rewrite does
    at the node besides, ``(kind, value)``: ``("size", (arg index, dim))`` a view's size along
    the sequence divided by cp; ``("mean_divisor", cp)`` a mean over the sequence divided by
    cp; ``("mean_loss", ignore_index)`` a mean loss made this rank's sum over every rank's
    count; ``("attention", None)`` attention made ``cp_attention``; ``("token_size", None)`` a
    size inside a mixture-of-experts block that counts its tokens divided by cp."""

    placement: object
    rule: str
    takes: Tuple[Tuple[fx.Node, object], ...] = ()
    sums: Tuple[fx.Node, ...] = ()
    note: Optional[Tuple[str, object]] = None


def register(*packets):
    def deco(fn):
        for pk in packets:
            RULES[pk] = fn
        return fn
    return deco


def rule_for(node: fx.Node):
    """The rule of a call: its op's, else the elementwise rule for an op tagged pointwise, else
    ``no_rule``."""
    pk = packet(node)
    fn = RULES.get(pk)
    if fn is not None:
        return fn
    if isinstance(pk, torch._ops.OpOverloadPacket) and torch.Tag.pointwise in node.target.tags:
        return RULES["pointwise"]
    return no_rule


def tensor_inputs(node):
    return [a for a in node.all_input_nodes if isinstance(val(a), torch.Tensor)]


def partials(view, node) -> Tuple[fx.Node, ...]:
    """The inputs of ``node`` that hold a partial sum over cp."""
    return tuple(a for a in node.all_input_nodes if view.get(a) == P)


def summed(view, node, placement, rule: str, takes=(), note=None) -> Outcome:
    """The outcome of an op that needs every input whole or chunked: its partial inputs summed."""
    return Outcome(placement, rule, tuple(takes), partials(view, node), note)


def no_rule(view, node, split) -> Outcome:
    """Any op without a rule runs whole; with this rank's chunks it is refused."""
    if split:
        view.fail(node, f"has no context-parallel rule for {packet(node)}")
    v = val(node)
    return summed(view, node, tuple(R for _ in v) if isinstance(v, (tuple, list)) else R, "whole")


def aligned_take(view, a: fx.Node, consumer: fx.Node, out, out_val: torch.Tensor) -> Tuple[Tuple[fx.Node, object], ...]:
    """Broadcasting alignment: a whole input ``a`` of an op whose output's sequence is where
    ``out`` has it holds, at the aligned dim, size 1 (broadcast: nothing to take), the whole
    sequence's size (taken: the one take returned), or no such dim (nothing to take)."""
    v = val(a)
    if not isinstance(v, torch.Tensor):
        return ()
    out_dim, inner = seq_of(out)
    d = out_dim - (out_val.ndim - v.ndim)
    if d < 0 or v.shape[d] == 1:
        return ()
    if v.shape[d] != out_val.shape[out_dim]:
        view.fail(consumer, f"reads {a.name} of shape {tuple(v.shape)} against a sequence of "
                            f"{out_val.shape[out_dim]} at its dim {d}")
    p = view.get(a)
    if seq_of(p) is not None and seq_of(p) != (d, inner):
        view.fail(consumer, f"combines tensors whose sequences lie differently ({p} at {a.name}, {out} at "
                            "the output)")
    return ((a, seq(d, inner)),)
