"""How rows reach their experts: the three dispatches found in the pinned transformers, as data.

Each ``Dispatch`` has a ``seed`` that recognises one matmul over the experts' weights (a
parameter with a leading experts dim, seen through casts and dim permutations) and says what
the matmuls of one block share (``Seed.key``), and a ``follow`` that walks from the block's
first matmul back to the router's top-k and the dispatched rows, step by step; each ``Step``
states what it requires, and the error quotes it when the graph does not hold it.

* ``SORTED`` (transformers' ``grouped_mm`` experts: Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE,
  gpt-oss, DeepSeek-V3): ``grouped_mm(rows, W, offs)`` (``aten._grouped_mm`` or
  ``transformers::grouped_mm_fallback``), W [E, ., .]; steps OFFSETS, SORT, TOPK, ROWS_SORTED.
* ``GATHERED`` (transformers' ``batched_mm`` experts): ``bmm`` of each row by ``W[ids]``, its
  expert's weight gathered by id; steps TOPK, ROWS_GATHERED.
* ``DENSE`` (Llama 4): ``bmm(x [E, T, in], W [E, in, out])``, every token through every expert,
  scaled by [T, E] scores that are zero off the top-k; steps ROWS_DENSE, TOPK_DENSE.
* ``"loop"`` (JetMoE): one linear per expert over ``W[e]``; recognised as experts so that it is
  refused (LOOP), never silently left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, List, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.passes.expert_parallel.descriptor import DENSE, GATHERED, SORTED
from fxmegatron.passes.expert_parallel.trail import (CASTS, PERMUTES, RESHAPES, Step, Trail, describe, is_call,
                                                     is_item, item_of, linear_weight_operand, param_under,
                                                     under)
from fxmegatron.passes.tensor_parallel.nodes import arg, norm, packet, val

aten = torch.ops.aten

# grouped matmuls by qualified name (a library's op packet exists only once it is imported)
GROUPED_MM = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})

OFFSETS = Step("offsets", "the grouped matmul's offsets to be cumsum(histc(ids, bins=E, min=0, max=E-1), dim=0) "
                          "(through casts), E the size of the weight's experts dim")
SORT = Step("sort", "the histogram's ids to be the values of an ascending sort of the flat expert ids, whose "
                    "indices (the permutation) are read too")
TOPK = Step("top-k", "the expert ids to be the indices (output 1) of an aten.topk over E scores, through "
                     "reshapes and casts")
ROWS_SORTED = Step("rows", "the first expert matmul to read index(tokens, [permutation // k]) (through casts): "
                           "the token of each sorted (token, choice) pair, T*k of them")
ROWS_GATHERED = Step("rows", "the first expert matmul to read repeat_interleave(tokens, k, dim=0) (through "
                             "casts and unsqueeze): each token once per choice")
ROWS_DENSE = Step("rows", "the first expert matmul to read a view [E, T, h] of repeat(tokens, [E, 1]) times a "
                          "reshape of the transposed [T, E] routing scores")
LOOP = Step("dispatch", "the experts to run as one grouped or batched matmul over the whole [E, ., .] weight (a "
                        "loop of one matmul per expert over W[e], with data-dependent row counts, is not followed)")
TOPK_DENSE = Step("top-k", "the [T, E] routing scores to be computed from the indices of an aten.topk over E "
                           "scores (within 16 ops)")


@dataclass(frozen=True)
class Seed:
    """A matmul over an experts weight: ``x`` the rows operand, ``param`` the weight's get_attr,
    ``experts_dim`` the parameter dim the matmul's groups (or batch) run along, ``key`` what the
    block's matmuls share (the offsets, the ids; None for dense, linked by its rows)."""
    node: fx.Node
    x: fx.Node
    param: fx.Node
    experts_dim: int
    key: Optional[fx.Node]

    @property
    def num_experts(self) -> int:
        return val(self.param).shape[self.experts_dim]


@dataclass(frozen=True)
class Parts:
    """What ``follow`` found between the router and the first expert matmul."""
    topk: fx.Node
    expert_ids: fx.Node          # topk[1]
    top_k: int
    tokens: fx.Node              # [T, h]
    rows: fx.Node
    grouped_by: Optional[fx.Node] = None
    permutation: Optional[fx.Node] = None
    counts: Optional[fx.Node] = None
    offsets: Optional[fx.Node] = None
    weights: Optional[fx.Node] = None    # dense: the [T, E] scores the rows are scaled by


@dataclass(frozen=True)
class Dispatch:
    name: str
    seed: Callable[[fx.Node, Collection[str]], Optional[Seed]]
    follow: Callable[[List[Seed], Trail, int], Parts]
    steps: Tuple[Step, ...]
    reduces: str                  # what the combine sums over: "k" (each token's choices) or "E"


def _router(ids, trail: Trail, step: Step, num_experts: int) -> Tuple[fx.Node, int]:
    """(topk, k) when ``ids`` is topk's indices over ``num_experts`` scores."""
    trail.expect(is_item(ids, aten.topk, 1), step, lambda: f"they are {describe(ids)}")
    topk = ids.args[0]
    trail.see(topk)
    scores = val(topk.args[0])
    dim = norm(arg(topk, 2, "dim", -1), scores.ndim)
    trail.expect(scores.shape[dim] == num_experts, step,
                 lambda: f"{describe(topk)} ranks {scores.shape[dim]} scores, not {num_experts}")
    return topk, int(arg(topk, 1, "k"))


# ---- sorted: transformers' grouped_mm ----------------------------------------------------------
def sorted_seed(node: fx.Node, params) -> Optional[Seed]:
    if getattr(packet(node), "_qualified_op_name", None) not in GROUPED_MM:
        return None
    x, offs = node.args[0], arg(node, 2, "offs")
    p = param_under(node.args[1], params)
    if p is None or val(p[0]).ndim != 3 or not isinstance(offs, fx.Node) or val(x) is None or val(x).ndim != 2:
        return None
    return Seed(node, x, p[0], p[1][0], offs)


def _sort_order(sort: fx.Node) -> bool:
    """An ascending sort (``sort.default`` or ``sort.stable``)."""
    positional = sort.args[2] if sort.target is aten.sort.default and len(sort.args) > 2 else False
    return not sort.kwargs.get("descending", positional)


def _token_of(idx, perm: fx.Node, k: int) -> bool:
    """``idx`` is ``perm // k``: the token of each sorted (token, choice) pair."""
    if is_call(idx, aten.floor_divide):
        return idx.args[0] is perm and idx.args[1] == k
    return (is_call(idx, aten.div) and idx.args[0] is perm and idx.args[1] == k
            and idx.kwargs.get("rounding_mode") == "floor")


def follow_sorted(seeds: List[Seed], trail: Trail, num_experts: int) -> Parts:
    first = seeds[0]
    cum = under(first.key, CASTS, trail)
    trail.expect(is_call(cum, aten.cumsum) and norm(arg(cum, 1, "dim"), 1) == 0, OFFSETS,
                 lambda: f"they are {describe(cum)}")
    hist = under(cum.args[0], CASTS, trail)
    trail.expect(is_call(hist, aten.histc), OFFSETS, lambda: f"the cumsum sums {describe(hist)}")
    bounds = (arg(hist, 1, "bins", 100), arg(hist, 2, "min", 0), arg(hist, 3, "max", 0))
    trail.expect(bounds == (num_experts, 0, num_experts - 1), OFFSETS,
                 f"the histogram has (bins, min, max) = {bounds} for E = {num_experts}")
    sorted_ids = under(hist.args[0], CASTS, trail)
    trail.expect(is_item(sorted_ids, aten.sort, 0) and _sort_order(sorted_ids.args[0]), SORT,
                 lambda: f"it counts {describe(sorted_ids)}")
    sort = sorted_ids.args[0]
    perm = item_of(sort, 1)
    trail.expect(perm is not None, SORT, f"{describe(sort)}'s permutation is not read")
    trail.see(sort, perm)
    ids = under(sort.args[0], CASTS | RESHAPES, trail)
    topk, k = _router(ids, trail, TOPK, num_experts)
    rows = under(first.x, CASTS, trail)
    ok = is_call(rows, aten.index) and len(rows.args[1]) == 1
    idx = under(rows.args[1][0], CASTS, trail) if ok else None
    trail.expect(ok and _token_of(idx, perm, k) and val(rows.args[0]).shape[0] * k == val(perm).shape[0],
                 ROWS_SORTED, lambda: f"{describe(first.node)} reads {describe(rows)}")
    return Parts(topk, ids, k, rows.args[0], rows, sorted_ids, perm, hist, first.key)


# ---- gathered: transformers' batched_mm ----------------------------------------------------------
def _gathered_weight(w, params):
    """(parameter get_attr, ids) when ``w`` is ``P[ids]`` of a 3-D parameter (through casts)."""
    g = under(w, CASTS)
    if not (is_call(g, aten.index) and len(g.args[1]) == 1 and isinstance(g.args[1][0], fx.Node)):
        return None
    p = g.args[0]
    if not (p.op == "get_attr" and p.target in params and val(p) is not None and val(p).ndim == 3):
        return None
    return p, g.args[1][0]


def gathered_seed(node: fx.Node, params) -> Optional[Seed]:
    if not is_call(node, aten.bmm):
        return None
    a, b = node.args[:2]
    for w, x in ((a, b), (b, a)):
        found = _gathered_weight(w, params)
        if found is not None:
            return Seed(node, x, found[0], 0, found[1])
    return None


def follow_gathered(seeds: List[Seed], trail: Trail, num_experts: int) -> Parts:
    first = seeds[0]
    ids = under(first.key, CASTS | RESHAPES, trail)
    topk, k = _router(ids, trail, TOPK, num_experts)
    rows = under(first.x, CASTS | {aten.unsqueeze}, trail)
    trail.expect(is_call(rows, aten.repeat_interleave) and arg(rows, 1, "repeats") == k
                 and arg(rows, 2, "dim") == 0, ROWS_GATHERED, lambda: f"{describe(first.node)} reads {describe(rows)}")
    return Parts(topk, ids, k, rows.args[0], rows, grouped_by=first.key)


# ---- dense: Llama 4 --------------------------------------------------------------------------------
def dense_seed(node: fx.Node, params) -> Optional[Seed]:
    if not is_call(node, aten.bmm):
        return None
    x, w = node.args[:2]
    p = param_under(w, params)
    if p is None or val(p[0]).ndim != 3:
        return None
    return Seed(node, x, p[0], p[1][0], None)


def _scores_topk(scores: fx.Node, trail: Trail, num_experts: int):
    """The topk whose indices the [T, E] scores are computed from (breadth first, 16 ops)."""
    todo, seen = [scores], []
    while todo and len(seen) < 16:
        n = todo.pop(0)
        if n in seen or n.op != "call_function":
            continue
        seen.append(n)
        if is_item(n, aten.topk, 1) and val(n.args[0].args[0]).shape[-1] == num_experts:
            return n
        todo.extend(n.all_input_nodes)
    trail.see(*seen)
    trail.fail(TOPK_DENSE, f"no topk over {num_experts} scores was found from {describe(scores)}")


def follow_dense(seeds: List[Seed], trail: Trail, num_experts: int) -> Parts:
    first = seeds[0]
    view = first.x
    trail.see(view)
    found = None
    if is_call(view, *RESHAPES) and val(view).ndim == 3 and val(view).shape[0] == num_experts:
        mul = under(view.args[0], CASTS, trail)
        if is_call(mul, aten.mul) and len(mul.all_input_nodes) == 2:
            for a, b in (mul.args[:2], mul.args[1::-1]):
                rep = under(a, CASTS, trail)
                if is_call(rep, aten.repeat) and list(rep.args[1]) == [num_experts, 1]:
                    found = (rep, under(b, CASTS | RESHAPES | PERMUTES, trail))
    tokens = found[0].args[0] if found else None
    trail.expect(found is not None and tuple(val(found[1]).shape) == (val(tokens).shape[0], num_experts),
                 ROWS_DENSE, lambda: f"{describe(first.node)} reads {describe(view)}")
    ids = _scores_topk(found[1], trail, num_experts)
    topk, k = _router(ids, trail, TOPK_DENSE, num_experts)
    return Parts(topk, ids, k, tokens, view, weights=found[1])


# ---- a loop of one matmul per expert (JetMoE): recognised as experts, never followed ------------------
def loop_seed(node: fx.Node, params) -> Optional[Seed]:
    """A linear whose weight is ``W[e]`` (``select``) of a 3-D parameter and whose rows are a
    data-dependent number (routed rows, not a stack of layers' weights), keyed by the parameter."""
    w = linear_weight_operand(node)
    s = under(w, CASTS | PERMUTES) if w is not None else None
    if not (is_call(s, aten.select) and s.args[0].op == "get_attr" and s.args[0].target in params
            and val(s.args[0]).ndim == 3 and val(node.args[0]) is not None
            and isinstance(val(node.args[0]).shape[0], torch.SymInt)):
        return None
    return Seed(node, node.args[0], s.args[0], norm(s.args[1], 3), s.args[0])


def follow_loop(seeds: List[Seed], trail: Trail, num_experts: int) -> Parts:
    trail.see(*(s.node for s in seeds))
    trail.fail(LOOP, f"{len(seeds)} matmuls each read one expert's slice W[e] of {seeds[0].param.target}")


DISPATCHES = (
    Dispatch(SORTED, sorted_seed, follow_sorted, (OFFSETS, SORT, TOPK, ROWS_SORTED), "k"),
    Dispatch(GATHERED, gathered_seed, follow_gathered, (TOPK, ROWS_GATHERED), "k"),
    Dispatch(DENSE, dense_seed, follow_dense, (ROWS_DENSE, TOPK_DENSE), "E"),
    Dispatch("loop", loop_seed, follow_loop, (LOOP,), "k"),
)
