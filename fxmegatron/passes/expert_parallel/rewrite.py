"""Expert parallelism's rewrite, the all-gather dispatcher (Megatron-core's
``MoEAllGatherTokenDispatcher``): each of ``ep`` ranks holds E/ep whole experts of every
block and computes them for the tokens of all ``ep`` ranks.

Per block found by ``find_experts`` (sorted dispatch), on the rank's graph with its expert
weights already cut to E/ep along their experts dim:

1. the block's three inputs, the tokens its rows are taken from, the [T, k] expert ids and the
   [T, k] routing weights, are all-gathered over ep (``gather_seq`` along dim 0: its gradient
   is the reduce-scatter that sums every rank's share back to the tokens' owner);
2. ids of this rank's experts become local ids (id − rank·E/ep); every other id becomes the
   sentinel E/ep and its weight 0 (the sort puts sentinels last and ``histc(bins=E/ep,
   max=E/ep−1)`` leaves them out, so no grouped matmul reads them);
3. the ops between those inputs and the combine run as captured, on ep·T tokens: the
   token-counted sizes they hold (``region.token_sizes``) are scaled by ep, the histogram's bins are E/ep;
4. each expert matmul's rows past the last offset are zeroed on the way in and out (a grouped
   matmul leaves them unwritten, and in backward their gradient would reach the tokens);
   An expert bias gathered by expert id reads its local row (sentinel rows clamped, then zeroed);
5. the combine, this rank's experts' share of every gathered token's output, is
   reduce-scattered over ep: each rank gets the sum for its own T tokens (gradient: all-gather).
6. the rows per local expert over all ep ranks' tokens are recorded for the trainer's
   load-imbalance figure (``ops.expert_load.record_expert_counts``, keyed by the block's module
   path; nothing reads its output, and on fake tensors it does nothing): the histogram of step 3
   where the block has one (the sorted dispatch), else counted from the local ids (the gathered
   dispatch) or from the local scores that are not 0 (the dense one).

Exactness: every gathered row is computed by the expert that computed it on one GPU; the
rows of the other experts are exact zeros; the sum over ep adds each token's k products
(in another order than the one-GPU sum over k: equal to rounding).

Preconditions (``ExpertParallelError`` naming the block where one fails): a sorted, gathered
or dense dispatch; the histogram, where there is one, is ``histc(ids, E, 0, E − 1)``; and those
of the block's region (``region.py``: closed, its token counts read from its sizes). A size the
rule reads wrongly changes a view's element count, which the shape check after this pass refuses.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch
import torch.fx as fx

from fxmegatron.errors import ExpertParallelError
from fxmegatron.ops.collectives import gather_seq, scatter_seq
from fxmegatron.ops.expert_load import RECORD as RECORD_EXPERT_COUNTS
from fxmegatron.passes.expert_parallel.descriptor import DENSE, GATHERED, SORTED, ExpertsBlock
from fxmegatron.passes.expert_parallel.region import (block_inputs, block_node, check_region, counted_sizes, region,
                                                      scale_tokens, token_sizes)

aten = torch.ops.aten

# node.meta keys: a node of a block's rewritten region (it holds every ep rank's tokens), and the
# reduce-scatter that leaves the block (its module path); verify's comparison reads both
EP_REGION, EP_BLOCK = "ep_region", "ep_block"

# the dense dispatch: op -> its shape argument, whose leading E (experts) or T (tokens) is rescaled
DENSE_SIZE_ARGS = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1,
                   aten.repeat.default: 1, aten.expand.default: 1}


def expert_params(blocks: Sequence[ExpertsBlock]) -> Dict[str, int]:
    """{parameter: its experts dim} for every expert weight and expert bias of ``blocks``."""
    out: Dict[str, int] = {}
    for b in blocks:
        for m in b.matmuls:
            out[m.weight] = m.experts_dim
            if m.bias is not None:
                out[m.bias] = 0
    return out


def check_supported(blocks: Sequence[ExpertsBlock]) -> None:
    """What the all-gather dispatcher is built for: the sorted and gathered dispatches
    (transformers' grouped_mm and batched_mm experts)."""
    for b in blocks:
        if b.dispatch not in (SORTED, GATHERED, DENSE):
            raise ExpertParallelError(f"expert parallelism of {b.module}: its experts are a {b.dispatch} dispatch, "
                                      "which has no rewrite: leave ep at 1 for this model")


def apply_expert_parallel(gm: fx.GraphModule, blocks: Sequence[ExpertsBlock], ep: int, rank: int,
                          group: str) -> fx.GraphModule:
    """Rewrite every block of ``blocks`` (found on an earlier copy of this graph: nodes are
    looked up by name) for rank ``rank`` of ``ep``, its collectives on ``group``."""
    if ep == 1:
        return gm
    check_supported(blocks)
    by_name = {n.name: n for n in gm.graph.nodes}
    for b in blocks:
        _rewrite_block(gm.graph, b, by_name, ep, rank, group)
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite_dense(graph: fx.Graph, b: ExpertsBlock, by_name, ep: int, rank: int, group: str) -> None:
    """Every token through every expert (Llama 4): the [T, E] scores are 0 off the top-k. Each
    rank takes its E/ep columns of every ep rank's scores and its E/ep blocks of the [E, ep·T, h]
    rows; the sum over experts is then this rank's share, reduce-scattered over ep."""
    E, local_e = b.num_experts, b.num_experts // ep
    # the [T, h] tokens the dense rows ([E, T, h]: their product with the scores) repeat
    tokens, weights = block_inputs(by_name, b)
    combine = block_node(by_name, b.combine, b)
    nodes = region(combine, {tokens, weights})
    check_region(nodes, combine, b)
    T = tokens.meta["val"].shape[0]
    if E == T:
        raise ExpertParallelError(f"expert parallelism of {b.module}: {T} tokens and {E} experts: a size of {E} "
                                  "could count either; trace with another batch size")
    lo = rank * local_e
    tok_g, w_g = _gather(graph, (tokens, weights), ep, group)
    with graph.inserting_before(_next(w_g)):
        w_l = graph.call_function(aten.slice.Tensor, (w_g, 1, lo, lo + local_e))
    with graph.inserting_before(_next(w_l)):     # a token's row for an expert: its score is not 0
        _record(graph, graph.call_function(aten.sum.dim_IntList, (graph.call_function(aten.ne.Scalar, (w_l, 0)), [0])),
                b, combine)
    _swap(nodes, {tokens: tok_g, weights: w_l})
    for n in nodes:
        at = DENSE_SIZE_ARGS.get(n.target)
        if at is not None and len(n.args) > at and isinstance(n.args[at], (list, tuple)) and n.args[at]:
            size = list(n.args[at])
            if size[0] == E:        # [E, ...] -> [E/ep, ...]; [E, T, ...] -> [E/ep, ep·T, ...]
                size[0] = local_e
                if len(size) > 1 and size[1] == T:
                    size[1] = T * ep
            elif size[0] == T:      # [T, ...] -> [ep·T, ...]; E·T rows stay E/ep · ep·T
                size[0] = T * ep
            n.args = (*n.args[:at], size, *n.args[at + 1:])
    _leave(graph, b, combine, nodes, ep, group)


def _rewrite_block(graph: fx.Graph, b: ExpertsBlock, by_name, ep: int, rank: int, group: str) -> None:
    if b.dispatch == DENSE:
        return _rewrite_dense(graph, b, by_name, ep, rank, group)
    E = b.num_experts
    local_e = E // ep
    tokens, ids, weights = block_inputs(by_name, b)
    combine = block_node(by_name, b.combine, b)
    nodes = region(combine, {tokens, ids, weights})
    check_region(nodes, combine, b)
    # 3 (found before the inputs are swapped): sizes that count tokens
    sized = token_sizes(nodes, (tokens, ids, weights), counted_sizes(b, tokens.meta["val"].shape[0]))
    counts = block_node(by_name, b.counts, b) if b.counts is not None else None
    if counts is not None and (counts.target is not aten.histc.default or list(counts.args[1:4]) != [E, 0, E - 1]):
        raise ExpertParallelError(f"expert parallelism of {b.module}: the rows per expert {counts.name} are "
                                  f"{counts.target}{tuple(counts.args[1:])}, not histc(ids, {E}, 0, {E - 1})")

    # 1-2: the gathered inputs, ids remapped, weights of other ranks' experts zeroed
    lo = rank * local_e
    tok_g, ids_g, w_g = _gather(graph, (tokens, ids, weights), ep, group)
    with graph.inserting_before(_next(w_g)):
        ge = graph.call_function(aten.ge.Scalar, (ids_g, lo))
        lt = graph.call_function(aten.lt.Scalar, (ids_g, lo + local_e))
        mine = graph.call_function(aten.logical_and.default, (ge, lt))
        shifted = graph.call_function(aten.sub.Tensor, (ids_g, lo))
        sentinel = graph.call_function(aten.full_like.default, (ids_g, local_e))
        ids_l = graph.call_function(aten.where.self, (mine, shifted, sentinel))
        zero = graph.call_function(aten.zeros_like.default, (w_g,))
        w_l = graph.call_function(aten.where.self, (mine, w_g, zero))
    _swap(nodes, {tokens: tok_g, ids: ids_l, weights: w_l})
    # 3: the sizes that count tokens count ep times as many, and the histogram has E/ep bins
    for n in sized:
        scale_tokens(n, lambda size: size * ep)
    if counts is not None:
        counts.args = (counts.args[0], local_e, 0, local_e - 1, *counts.args[4:])
        # the rows per local expert over every ep rank's tokens, kept for the trainer's load figure
        # (``ops.expert_load``: an effectful op, no output, a no-op on fake tensors)
        with graph.inserting_before(_next(counts)):
            _record(graph, counts, b, combine)
    else:       # no histogram (the gathered dispatch): the rows per local expert counted from the ids
        with graph.inserting_before(_next(w_l)):
            flat = graph.call_function(aten.reshape.default, (ids_l, [-1]))
            bins = graph.call_function(aten.new_zeros.default, (flat, [local_e + 1]))
            ones = graph.call_function(aten.ones_like.default, (flat,))
            hist = graph.call_function(aten.scatter_add.default, (bins, 0, flat, ones))
            _record(graph, graph.call_function(aten.slice.Tensor, (hist, 0, 0, local_e)), b, combine)
    # 4: the rows of other ranks' experts (the sentinel's: sorted last in the sorted dispatch) zeroed
    # around each expert matmul, and expert weights and biases gathered by a row's id read a local row
    grouped = block_node(by_name, b.grouped_by, b)
    with graph.inserting_before(_next(grouped)):
        valid = graph.call_function(aten.lt.Scalar, (grouped, local_e))
        clamped = graph.call_function(aten.clamp.default, (grouped, 0, local_e - 1))
    experts = {m.weight for m in b.matmuls} | {m.bias for m in b.matmuls if m.bias is not None}
    for n in nodes:
        if n.target is aten.index.Tensor and _param(n.args[0]) in experts and grouped in n.args[1]:
            n.args = (n.args[0], [clamped if i is grouped else i for i in n.args[1]], *n.args[2:])
            if _param(n.args[0]) not in {m.weight for m in b.matmuls}:     # a bias's rows: zeroed too
                _mask_output(graph, n, valid)
    for m in b.matmuls:
        mm = block_node(by_name, m.node, b)
        x = mm.args[0]
        with graph.inserting_before(mm):
            mask = _row_mask(graph, valid, x.meta["val"].dim())
            xin = graph.call_function(aten.where.self, (mask, x, graph.call_function(aten.zeros_like.default, (x,))))
        mm.args = (xin, *mm.args[1:])
        _mask_output(graph, mm, valid)
    _leave(graph, b, combine, nodes, ep, group)


def _gather(graph: fx.Graph, sources: Sequence[fx.Node], ep: int, group: str) -> List[fx.Node]:
    """Step 1: each of ``sources`` all-gathered over ep, one after the other, after the last of
    them (an op between a gather and its source, such as the routing weights' in-place
    renormalisation, would otherwise sit past a collective that recompute cuts its regions at)."""
    last = max(sources, key=lambda n: _order(graph, n))
    with graph.inserting_before(_next(last)):
        return [graph.call_function(gather_seq, (src, 0, ep, group)) for src in sources]


def _swap(nodes: List[fx.Node], swap: Mapping[fx.Node, fx.Node]) -> None:
    """Every node of ``nodes`` reads the gathered (or remapped) values in place of the block's inputs."""
    for n in nodes:
        n.args = fx.map_arg(n.args, lambda a: swap.get(a, a))
        n.kwargs = fx.map_arg(n.kwargs, lambda a: swap.get(a, a))


def _record(graph: fx.Graph, counts: fx.Node, b: ExpertsBlock, combine: fx.Node) -> None:
    """Step 6: ``counts`` (rows per local expert over every ep rank's tokens) recorded for the
    trainer's load figure, in the block's module (a pipeline cut or recompute keeps it there)."""
    rec = graph.call_function(RECORD_EXPERT_COUNTS, (counts, b.module))
    if "nn_module_stack" in combine.meta:
        rec.meta["nn_module_stack"] = combine.meta["nn_module_stack"]


def _leave(graph: fx.Graph, b: ExpertsBlock, combine: fx.Node, nodes: List[fx.Node], ep: int, group: str) -> None:
    """Step 5: the combine (this rank's experts' share of every gathered token) reduce-scattered
    over ep, each rank keeping its own tokens' sums; the region marked for verify's comparison."""
    with graph.inserting_before(_next(combine)):
        out = graph.call_function(scatter_seq, (combine, 0, ep, group))
    combine.replace_all_uses_with(out, delete_user_cb=lambda u: u is not out)
    for n in nodes:
        n.meta[EP_REGION] = True
    out.meta[EP_BLOCK] = b.module


def _param(n) -> str:
    return n.target if isinstance(n, fx.Node) and n.op == "get_attr" else ""


def _row_mask(graph: fx.Graph, valid: fx.Node, dim: int) -> fx.Node:
    """``valid`` [rows] viewed to broadcast over a tensor of ``dim`` dims led by the rows."""
    return graph.call_function(aten.view.default, (valid, [-1] + [1] * (dim - 1)))


def _mask_output(graph: fx.Graph, n: fx.Node, valid: fx.Node) -> None:
    with graph.inserting_before(_next(n)):
        mask = _row_mask(graph, valid, n.meta["val"].dim())
        zero = graph.call_function(aten.zeros_like.default, (n,))
        out = graph.call_function(aten.where.self, (mask, n, zero))
    n.replace_all_uses_with(out, delete_user_cb=lambda u: u not in (zero, out))


def _next(node: fx.Node) -> fx.Node:
    # inserting before the next node keeps several new nodes in the order they are made
    # (inserting_after puts each right after the anchor: the last made first)
    return node.next


def _order(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise KeyError(node.name)


def _device(node: fx.Node):
    v = node.meta.get("val")
    # a device constant is pointed at the rank's device when it is materialised (retarget_device)
    return v.device if isinstance(v, torch.Tensor) else torch.device("cpu")
