"""Recognise each mixture-of-experts block of a captured graph from its ops.

``find_experts(gm)`` starts from the matmuls over expert weights: a parameter with a leading
experts dim (3-D, seen through casts and dim permutations) multiplied by rows, as one of the
dispatches of ``dispatch.DISPATCHES`` recognises it (a grouped matmul over offsets, a ``bmm``
over weights gathered by expert id, a ``bmm`` over the weight itself). The matmuls that share
their grouping (the offsets, the ids, or, dense, rows computed from an earlier one's result
by elementwise ops and splits) form one block. For each block it walks back to the router's
top-k and the dispatched rows (the dispatch's ``follow``), forward to the combine
(``combine.find_combine``), and records the expert biases, the router's linear and the shared
experts where they are found. Module names play no part: the module path is only reported.

Preconditions, as each step states them (``Step.requires``), are in dispatch.py and
combine.py; a matmul over expert weights whose walk fails raises ``ExpertParallelError``
naming the module, the step, what it requires, and the nodes seen. A graph without such a
matmul gives [].
"""
from __future__ import annotations

import operator
from typing import Collection, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.passes.expert_parallel.combine import (BIAS, COMBINE, UNPERMUTE, expert_bias, find_combine, find_shared,
                                                       router_matmul)
from fxmegatron.passes.expert_parallel.descriptor import DENSE, ExpertMatmul, ExpertsBlock, Router
from fxmegatron.passes.expert_parallel.dispatch import DISPATCHES, Dispatch, Seed
from fxmegatron.passes.expert_parallel.trail import CASTS, SPLITS, Step, Trail, common_module, describe
from fxmegatron.passes.tensor_parallel.nodes import packet

SAME_E = Step("experts", "every expert weight of one block to have the same number of experts E along its "
                         "experts dim")

_LINK_LIMIT = 64


def _keeps_rows(n: fx.Node) -> bool:
    """An op between two dense expert matmuls: elementwise, a cast, a split, an element of one."""
    if n.op != "call_function":
        return False
    return (n.target is operator.getitem or packet(n) in (CASTS | SPLITS)
            or torch.Tag.pointwise in getattr(n.target, "tags", ()))


def _link(seed: Seed, keys: Dict[fx.Node, fx.Node]) -> fx.Node:
    """The block of a dense expert matmul: that of the earlier one its rows are computed from
    (by ``_keeps_rows`` ops), else its own (it is the block's first)."""
    todo, seen = [seed.x], set()
    while todo and len(seen) < _LINK_LIMIT:
        n = todo.pop()
        if n in keys:
            return keys[n]
        if n in seen or not _keeps_rows(n):
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seed.node


def _seeds(gm: fx.GraphModule, params: Collection[str]):
    """{(dispatch, key): (dispatch, its matmuls in graph order)}, in the order blocks start."""
    groups: Dict[tuple, tuple] = {}
    dense_keys: Dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for d in DISPATCHES:
            s = d.seed(node, params)
            if s is None:
                continue
            key = s.key
            if key is None:
                key = dense_keys[node] = _link(s, dense_keys)
            groups.setdefault((d.name, key), (d, []))[1].append(s)
            break
    return groups


def recognise(d: Dispatch, seeds: List[Seed], params: Collection[str], order: Dict[fx.Node, int]) -> ExpertsBlock:
    """The descriptor of the block whose expert matmuls are ``seeds`` (graph order)."""
    first = seeds[0]
    trail = Trail(module_path(first.node), first.node)
    trail.see(first.param)
    n_exp = first.num_experts
    for s in seeds[1:]:
        trail.see(s.node, s.param)
        trail.expect(s.num_experts == n_exp, SAME_E, lambda: f"{s.param.target} has {s.num_experts} along dim "
                                                             f"{s.experts_dim}, {first.param.target} {n_exp}")
    parts = d.follow(seeds, trail, n_exp)
    unpermute, combine, weights = find_combine(seeds[-1].node, parts, d, n_exp, trail, params)
    matmuls = tuple(ExpertMatmul(s.node, s.param.target, s.experts_dim,
                                 *expert_bias(s.node, parts.grouped_by, n_exp, params)) for s in seeds)
    r_mm, r_weight = router_matmul(parts.topk, n_exp, params)
    router = Router(parts.topk, parts.topk.args[0], parts.expert_ids, weights, r_mm, r_weight)
    module = common_module([module_path(n) for n in (parts.topk, combine, *(s.node for s in seeds))])
    return ExpertsBlock(module=module, num_experts=n_exp, top_k=parts.top_k, dispatch=d.name, tokens=parts.tokens,
                        router=router, rows=parts.rows, grouped_by=parts.grouped_by, permutation=parts.permutation,
                        counts=parts.counts, offsets=parts.offsets, matmuls=matmuls, unpermute=unpermute,
                        combine=combine, shared=find_shared(combine, parts.tokens, params, order))


def find_experts(gm: fx.GraphModule, params: Optional[Collection[str]] = None) -> List[ExpertsBlock]:
    """One ``ExpertsBlock`` per mixture-of-experts block of ``gm``, in graph order. ``params``:
    the names of the parameters (default: ``gm``'s). Raises ``ExpertParallelError`` for a
    matmul over expert weights whose block cannot be followed."""
    params = set(params) if params is not None else {n for n, _ in gm.named_parameters()}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [recognise(d, seeds, params, order) for d, seeds in _seeds(gm, params).values()]


def preconditions() -> List[Tuple[str, str, str]]:
    """(dispatch, step, what it requires) for every step of every dispatch, then the combine's."""
    rows = [(d.name, s.name, s.requires) for d in DISPATCHES for s in d.steps + (SAME_E,)]
    return rows + [("all", s.name, s.requires) for s in (COMBINE, UNPERMUTE, BIAS)]


def describe_block(block: ExpertsBlock) -> str:
    """The block's nodes, one line each, for a dump or a report."""
    lines = [block.summary()]
    for label, n in (("top-k", block.router.topk), ("router", block.router.matmul), ("rows", block.rows),
                     ("offsets", block.offsets), ("unpermute", block.unpermute), ("combine", block.combine)):
        if n is not None:
            lines.append(f"  {label}: {describe(n)}")
    for m in block.matmuls:
        lines.append(f"  matmul: {describe(m.node)} weight {m.weight} (experts dim {m.experts_dim})"
                     f"{' bias ' + m.bias if m.bias else ''}")
    if block.dispatch == DENSE:
        lines.append(f"  scores: {describe(block.router.weights)}")
    return "\n".join(lines)
