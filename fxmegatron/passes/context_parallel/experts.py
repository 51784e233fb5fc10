"""Context parallelism through a mixture-of-experts block (``passes.expert_parallel``'s
``ExpertsBlock``): a rank runs the block on its own tokens.

Routing is per token: each token's output is the sum of its k experts' rows, scaled by its own
routing weights, whichever other tokens the block sees. So the ops from the block's inputs (the
tokens, the [T, k] expert ids and the [T, k] routing weights) to its combine run as captured on
this rank's T/cp tokens (the sort, the histogram and the grouped matmuls over its rows alone),
the sizes in them that count tokens divided by cp (``expert_parallel.region.token_sizes``), and
the combine's [T, h] result holds this rank's chunks as the tokens did. The rows in between
follow the dispatch's own order, no chunk of the sequence: they have no cp placement (verify
compares the combine, not them).

Preconditions, each refused naming the block: a sorted or gathered dispatch (the dense one's
[E, T, h] rows have no rule yet); the block's three inputs are this rank's chunks of the
sequence along their dim 0, alike; the region reads nothing else that holds the sequence; and
the region's own (``expert_parallel.region``: closed, its token counts read from its sizes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence, Set, Tuple

import torch.fx as fx

from fxmegatron.errors import ShardingError
from fxmegatron.passes.context_parallel.layout import is_split, seq, seq_of
from fxmegatron.passes.context_parallel.registry import Outcome
from fxmegatron.passes.expert_parallel.descriptor import DENSE, ExpertsBlock
from fxmegatron.passes.expert_parallel.region import (block_inputs, block_node, check_region, counted_sizes, region,
                                                      token_sizes)
from fxmegatron.placement import R


@dataclass
class Block:
    """One block on the graph the cp pass walks: its inputs, its combine, the nodes between
    (calls only) and those among them whose size counts tokens."""
    module: str
    inputs: Tuple[fx.Node, ...]
    combine: fx.Node
    inside: Set[fx.Node] = field(default_factory=set)
    sized: Set[fx.Node] = field(default_factory=set)


def expert_blocks(gm: fx.GraphModule, blocks: Sequence[ExpertsBlock]) -> Dict[fx.Node, Block]:
    """{node: its block} for every call from a block's inputs to its combine (the combine
    included), on ``gm`` (the blocks were found on it or an earlier copy: looked up by name)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out: Dict[fx.Node, Block] = {}
    for b in blocks:
        if b.dispatch == DENSE:
            raise ShardingError(f"context parallelism of {b.module}: its experts are a dense dispatch (every token "
                                "through every expert, [E, T, h] rows), which has no context-parallel rule yet: "
                                "leave cp at 1 for this model")
        inputs = block_inputs(by_name, b)
        combine = block_node(by_name, b.combine, b)
        nodes = region(combine, set(inputs))
        check_region(nodes, combine, b)
        calls = [n for n in nodes if n.op == "call_function"]
        sized = token_sizes(calls, inputs, counted_sizes(b, inputs[0].meta["val"].shape[0]))
        block = Block(b.module, inputs, combine, set(calls) - {combine}, set(sized))
        for n in calls:
            out[n] = block
    return out


def experts_rule(view, node: fx.Node, block: Block) -> Outcome:
    """Inside the block: no placement (this rank's rows in the dispatch's order), a size that
    counts tokens divided by cp. The combine: the tokens' chunks, as the block's inputs hold them."""
    for a in node.all_input_nodes:
        if a not in block.inside and a not in block.inputs and view.get(a) != R:
            view.fail(node, f"reads {a.name} ({view.get(a)}) inside the mixture-of-experts block {block.module}, "
                            "which runs on this rank's tokens: only its tokens, expert ids and routing weights may "
                            "hold the sequence")
    note = ("token_size", None) if node in block.sized else None
    if node is not block.combine:
        return Outcome(None, "experts", note=note)
    placed = [view.get(a) for a in block.inputs]
    if not all(is_split(p) for p in placed) or len({seq_of(p) for p in placed}) != 1 or seq_of(placed[0])[0] != 0:
        view.fail(node, f"combines the mixture-of-experts block {block.module} whose tokens, expert ids and "
                        f"routing weights are {', '.join(map(str, placed))}: context parallelism runs a block on "
                        "this rank's tokens, its three inputs its chunks of the sequence alike along dim 0")
    return Outcome(seq(*seq_of(placed[0])), "experts.combine", note=note)
