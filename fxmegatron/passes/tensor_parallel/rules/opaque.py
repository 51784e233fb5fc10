"""Ops without a rule: every input is made whole and the output is replicated."""
from __future__ import annotations

import types

import torch

from fxmegatron.passes.tensor_parallel.nodes import packet, val
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.placement import R, Shard

aten = torch.ops.aten


def replicate_all(view, node, why=""):
    """Run ``node`` on whole inputs: partial sums are reduced (g), sequence shards gathered,
    and a split input demotes the column matmuls it came from, with ``why``. The rule is
    recorded as ``opaque: <why>`` when ``why`` is given, else as the calling rule."""
    for a in node.all_input_nodes:
        if isinstance(view.get(a), Shard):
            view.demote(view.orig(a), node, why)
        view.replicate(a, node)
    v = val(node)
    return view.set(node, tuple(R for _ in v) if isinstance(v, (tuple, list)) else R,
              rule=f"opaque: {why}" if why else None)


def no_rule(view, node):
    """Any op the table does not know. Precondition: none; it always runs replicated, and a
    split reaching it is demoted (or gathered) with the reason "has no sharding rule"."""
    return replicate_all(view, node, f"has no sharding rule for {_op_name(packet(node))}")


no_rule.rule_name = "opaque"


@register(aten._assert_tensor_metadata, name="metadata")
def assert_metadata(view, node):
    """A check on its input's metadata, no output: nothing to place."""
    return view.set(node, R)


def _op_name(op) -> str:
    """An op as the dump prints it: ``aten.mm``, or a Python function's qualified name (its repr
    carries an address, which would make placements.txt differ run to run)."""
    if isinstance(op, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{op.__module__}.{op.__qualname__}"
    return str(op)
