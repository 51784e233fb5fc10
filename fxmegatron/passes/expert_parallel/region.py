"""A mixture-of-experts block's region, the ops from its inputs (the tokens, the [T, k] expert ids
and the [T, k] routing weights) to its combine, and the sizes in it that count tokens. Two
rewrites change how many tokens the region runs on without touching what it computes per
token: expert parallelism gathers every ep rank's (ep·T), context parallelism keeps the rank's
part of the sequence (T/cp). Both scale the same sizes, found here once.

Preconditions (``ExpertParallelError`` naming the block where one fails): the region reads no
graph input beyond the block's inputs, and nothing outside it reads a node inside it but the
combine's readers; a size argument that counts tokens is the first dim of a shape (of a view
computed from the block's inputs, or of a new tensor: an ``arange``'s length) and equals T or
T·k, E being neither. A size read wrongly changes a view's element count, which the shape check
after either rewrite refuses.
"""
from __future__ import annotations

from typing import Callable, List, Mapping, Sequence, Set, Tuple

import torch
import torch.fx as fx

from fxmegatron.errors import ExpertParallelError
from fxmegatron.passes.expert_parallel.descriptor import DENSE, ExpertsBlock

aten = torch.ops.aten

# op -> the argument holding a shape whose first entry may count tokens (an int: an arange's length)
SIZE_ARGS = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1,
             aten.new_zeros.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
             aten.zeros.default: 0, aten.empty.memory_format: 0, aten.full.default: 0, aten.arange.default: 0}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def block_node(by_name: Mapping[str, fx.Node], old: fx.Node, b: ExpertsBlock) -> fx.Node:
    """The node of this graph named as ``old`` (a node of the graph the block was found on)."""
    n = by_name.get(old.name)
    if n is None:
        raise ExpertParallelError(f"expert parallelism of {b.module}: node {old.name} of its experts computation is "
                                  "gone from the rank's graph (a pass before it replaced the node)")
    return n


def block_inputs(by_name: Mapping[str, fx.Node], b: ExpertsBlock) -> Tuple[fx.Node, ...]:
    """The block's inputs on this graph: (tokens, expert ids, routing weights); dense: (tokens,
    [T, E] scores)."""
    if b.router.weights is None:
        raise ExpertParallelError(f"expert parallelism of {b.module}: no routing weights were found for its rows")
    weights = block_node(by_name, b.router.weights, b)
    if b.dispatch == DENSE:
        return block_node(by_name, b.tokens, b), weights
    rows = block_node(by_name, b.rows, b)
    return rows.args[0], block_node(by_name, b.router.expert_ids, b), weights


def region(combine: fx.Node, stops: Set[fx.Node]) -> List[fx.Node]:
    """The nodes the combine is computed from, back to ``stops`` (not included) and the graph's
    attributes, in graph order."""
    seen, todo = set(), [combine]
    while todo:
        n = todo.pop()
        if n in seen or n in stops:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        todo.extend(n.all_input_nodes)
    return [n for n in combine.graph.nodes if n in seen]


def check_region(nodes: List[fx.Node], combine: fx.Node, b: ExpertsBlock) -> None:
    """The region is closed: no graph input but the block's, no reader outside but the combine's."""
    inside = set(nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    if placeholders:
        raise ExpertParallelError(f"expert parallelism of {b.module}: its combine reads the graph inputs "
                                  f"{placeholders} beyond the tokens, the expert ids and the routing weights")
    for n in nodes:
        if n is not combine:
            outside = [u.name for u in n.users if u not in inside]
            if outside:
                raise ExpertParallelError(f"expert parallelism of {b.module}: {n.name} ({n.target}) inside the "
                                          f"experts computation is also read by {outside} outside it")


def counted_sizes(b: ExpertsBlock, tokens: int) -> Set[int]:
    """The sizes that count the block's ``tokens`` rows (T, T·k), refused where E is one of them."""
    counted = {tokens, tokens * b.top_k}
    if b.num_experts in counted:
        raise ExpertParallelError(f"expert parallelism of {b.module}: {tokens} tokens, top-{b.top_k}: a size of "
                                  f"{b.num_experts} could count tokens or experts; trace with another batch size")
    return counted


def fed_by(nodes: List[fx.Node], sources: Set[fx.Node]) -> Set[fx.Node]:
    """The nodes of ``nodes`` (in graph order) computed from ``sources``."""
    fed = set(sources)
    for n in nodes:
        if any(a in fed for a in n.all_input_nodes):
            fed.add(n)
    return fed


def token_sizes(nodes: List[fx.Node], sources: Sequence[fx.Node], counted: Set[int]) -> List[fx.Node]:
    """The nodes of ``nodes`` whose size argument (``SIZE_ARGS``) counts tokens. A view or expand
    counts them only where it reads the block's inputs (a view of an expert weight keeps its
    sizes); a new tensor's size (arange, zeros, ...) has no input to tell, and is read by its value."""
    fed = fed_by(nodes, set(sources))
    out = []
    for n in nodes:
        if (n in fed or n.target not in VIEWS) and _counted(n, counted):
            out.append(n)
    return out


def scale_tokens(n: fx.Node, scale: Callable[[int], int]) -> None:
    """``n``'s token count (found by ``token_sizes``) replaced by ``scale`` of it. A token count
    past the first dim is left as it is: the view of other element counts then fails the shape
    check after the rewrite (it cannot pass silently)."""
    at = SIZE_ARGS[n.target]
    size = n.args[at]
    new = scale(size) if isinstance(size, int) else [scale(size[0]), *size[1:]]
    n.args = (*n.args[:at], new, *n.args[at + 1:])


def _counted(n: fx.Node, counted: Set[int]) -> bool:
    at = SIZE_ARGS.get(n.target)
    if at is None or len(n.args) <= at:
        return False
    size = n.args[at]
    if isinstance(size, int):
        return size in counted
    return isinstance(size, (list, tuple)) and bool(size) and isinstance(size[0], int) and size[0] in counted
