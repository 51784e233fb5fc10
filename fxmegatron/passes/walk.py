"""The walk every mesh axis's placement engine shares (docs/ENGINE.md).

An axis's engine is a rule table and a state. ``state.decide(node)`` asks the node's rule,
which reads placements through a read-only view, and returns its outcome (a structural node,
an input or the output, is decided by the state itself); ``state.record(node, outcome)``
writes the outcome into the axis's plan. Where an outcome learnt a constraint that changes
earlier decisions (tensor parallelism's demotions, forced replicas, fused blocks, forced
gathers), ``record`` keeps it and raises ``Restart``: the walk starts over from
``state.reset()``, and ends at a fixed point, since every attempt learns something new or
finishes. Context parallelism never restarts: one attempt.
"""
from __future__ import annotations

import torch.fx as fx


class Restart(Exception):
    """An outcome learnt a constraint; start the walk again."""


def walk(graph: fx.Graph, state, limit: int = 10_000) -> int:
    """Place every node of ``graph`` on one axis; returns the number of attempts."""
    for attempt in range(1, limit):
        state.reset()
        try:
            for node in graph.nodes:
                state.record(node, state.decide(node))
        except Restart:
            continue
        return attempt
    raise RuntimeError(f"placement did not converge in {limit} attempts")
