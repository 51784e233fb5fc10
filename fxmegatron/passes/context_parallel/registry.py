"""The context-parallel rule table (op packet -> rule) and what every rule shares. The rule
modules (``rules``, ``rules_compute``) fill the table when imported."""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import packet, val
from fxmegatron.placement import P, R

aten = torch.ops.aten
RULES: Dict[object, Callable] = {}


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


def sum_partials(state, node):
    for a in node.all_input_nodes:
        if state.get(a) == P:
            state.sum_for(a, node)


def no_rule(state, node, split):
    """Any op without a rule runs whole; with this rank's chunks it is refused."""
    if split:
        state.fail(node, f"has no context-parallel rule for {packet(node)}")
    sum_partials(state, node)
    v = val(node)
    state.set(node, tuple(R for _ in v) if isinstance(v, (tuple, list)) else R, "whole")
