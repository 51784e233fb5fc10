"""At tp=1 every tensor-parallel collective is the identity: drop them from the graph.

The tensor-parallel pass inserts f/g and the sequence-parallel gathers and scatters
whatever the tp size, so that one-process tests see the graph of a real split. At
run time on a tp group of one they are copies (a torch.library op may not return its
input), four activation copies per transformer block, and calls that torch.compile
cannot see through. The vocab-parallel cross-entropy stays: it is the fused loss.
"""
from __future__ import annotations

import torch.fx as fx

from fxmegatron.ops.collectives import local_shard
from fxmegatron.ops.registry import record


def _identity_alone(target) -> bool:
    rec = record(target)
    return rec is not None and rec.identity_alone


def drop_trivial_collectives(gm: fx.GraphModule) -> int:
    """Replace each collective node by its input; returns how many went."""
    gone = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and (n.target is local_shard or _identity_alone(n.target)):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
            gone += 1
    if gone:
        gm.graph.lint()
        gm.recompile()
    return gone
