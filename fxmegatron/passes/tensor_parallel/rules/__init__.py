"""Placement rules, one module per op family, registered against ATen ops in one table
(as DTensor's ``torch/distributed/tensor/_ops``). ``rule_for(node)`` finds a call's rule:
the op's registered rule, else the pointwise rule for an op tagged pointwise, else
``opaque.no_rule`` (everything replicated, with the reason).

Each rule is ``rule(view, node) -> Outcome`` (``view.py``): it reads its inputs' placements
through the view (``view.get``), which never writes the walk's state, and answers with the
outcome the view collects: the node's placement (``view.set``, which returns it), the
changes of placement at its inputs, the parameters it claims. Where its precondition fails
it replicates with the reason recorded, demotes the split's origins (``view.demote``: the
outcome then holds what was learnt and the walk restarts) or raises a ``ShardingError``
naming the node.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import packet
from fxmegatron.passes.tensor_parallel.rules import (
    attention, embedding, indexing, matmul, norms, opaque, pointwise, reductions, views)
from fxmegatron.passes.tensor_parallel.rules.registry import RULES, register

__all__ = ["RULES", "register", "rule_for"]

# importing a rule module registers its rules
RULE_MODULES = (attention, embedding, indexing, matmul, norms, opaque, pointwise, reductions, views)


def rule_for(node: fx.Node):
    """The placement rule of a call_function node."""
    pk = packet(node)
    # ops outside aten (a library's custom op) are registered by qualified name, since
    # their packet exists only once that library is imported
    fn = RULES.get(pk) or RULES.get(getattr(pk, "_qualified_op_name", None))
    if fn is not None:
        return fn
    if isinstance(pk, torch._ops.OpOverloadPacket) and torch.Tag.pointwise in node.target.tags:
        return pointwise.pointwise
    return opaque.no_rule
