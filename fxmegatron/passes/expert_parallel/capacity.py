"""An MoE capacity factor (``parallelize(..., moe_capacity_factor=cf)``): Megatron's
``moe_expert_capacity_factor`` with the "probs" drop policy, without padding to capacity.

On the tokens of one forward of a block (a rank's data-parallel piece, before any dispatch),
expert e keeps at most C = ceil(cf · T · k / E) of its (token, slot) assignments, those with
the largest routing weights, ties broken by token order; T is the block's tokens, k its top-k,
E its experts. A dropped assignment contributes nothing to its token's output: its combine
weight is 0 (and so is its gradient through that weight and the expert's).

``apply_capacity(gm, cf)`` runs on the captured graph, before expert parallelism finds the
blocks for its rewrite, and does not depend on ep: per block found by ``find_experts`` it puts
one ``moe_capacity_keep(ids, weights, E, C)`` node (``ops.moe_capacity``) right before the
combine's first read of the [T, k] routing weights, and a ``mul`` of the weights by it that
those reads take instead. The ep rewrite then gathers the masked weights, so the drops are the
rank's own tokens' at any ep.

Refused by name (``ExpertParallelError``): a model with no block; the dense dispatch (every
token through every expert, scaled by [T, E] scores: no per-assignment weight to drop); a block
whose routing weights were not found; the weights or ids changed in place after the combine
first reads them (the mask would rank other values than the combine scales by).
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.fx as fx

from fxmegatron.errors import ExpertParallelError
from fxmegatron.ops.moe_capacity import KEEP
from fxmegatron.passes.expert_parallel.descriptor import DENSE, ExpertsBlock
from fxmegatron.passes.expert_parallel.recognise import find_experts
from fxmegatron.passes.expert_parallel.trail import ancestors, describe
from fxmegatron.passes.node_meta import copy_source

aten = torch.ops.aten
CAPACITY = "moe_capacity"     # node.meta key of the keep-mask node: (block, C)


def check_capacity_factor(cf) -> None:
    """None (dropless) or a number > 0."""
    if cf is None:
        return
    if isinstance(cf, bool) or not isinstance(cf, numbers.Real) or not math.isfinite(cf) or cf <= 0:
        raise ExpertParallelError(f"parallelize(moe_capacity_factor={cf!r}): expected None (dropless) or a number "
                                  "> 0 (each expert keeps at most ceil(cf * T * k / E) of its assignments)")


def capacity(cf: float, tokens: int, top_k: int, num_experts: int) -> int:
    # C = ceil(cf * T * k / E) as docs/EXPERT_PARALLEL.md states it (at least 1 for cf > 0)
    return math.ceil(cf * tokens * top_k / num_experts)


def _mutates(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _mask_block(gm: fx.GraphModule, b: ExpertsBlock, cf: float) -> fx.Node:
    if b.dispatch == DENSE:
        raise ExpertParallelError(f"parallelize(moe_capacity_factor=...) of {b.module}: its experts are the dense "
                                  "dispatch (every token through every expert, scaled by [T, E] scores), which has no "
                                  "per-assignment weight to drop: leave moe_capacity_factor at None for this model")
    weights, ids = b.router.weights, b.router.expert_ids
    if weights is None:
        raise ExpertParallelError(f"parallelize(moe_capacity_factor=...) of {b.module}: no [T, k] routing weights "
                                  "were found scaling its rows, so there is no combine weight to set to 0")
    feeds = ancestors(b.combine)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    reads = sorted((u for u in weights.users if u in feeds and not _mutates(u)), key=order.__getitem__)
    if not reads:
        raise ExpertParallelError(f"parallelize(moe_capacity_factor=...) of {b.module}: the combine "
                                  f"{describe(b.combine)} does not read the routing weights {describe(weights)}")
    first = reads[0]
    late = [u for x in (weights, ids) for u in x.users if _mutates(u) and order[u] > order[first]]
    if late:
        raise ExpertParallelError(f"parallelize(moe_capacity_factor=...) of {b.module}: {describe(late[0])} changes "
                                  f"the routing weights or expert ids in place after the combine reads them")
    tokens = b.tokens.meta["val"].shape[0]
    cap = capacity(cf, tokens, b.top_k, b.num_experts)
    with gm.graph.inserting_before(first):
        keep = gm.graph.call_function(KEEP, (ids, weights, b.num_experts, cap))
        masked = gm.graph.call_function(aten.mul.Tensor, (weights, keep))
    val = weights.meta["val"]
    for n in (keep, masked):
        copy_source(n, first)
        n.meta["val"] = val.new_empty(val.shape)
    keep.meta[CAPACITY] = (b.module, cap)
    for u in reads:
        u.args = fx.map_arg(u.args, lambda a: masked if a is weights else a)
        u.kwargs = fx.map_arg(u.kwargs, lambda a: masked if a is weights else a)
    return keep


def apply_capacity(gm: fx.GraphModule, cf: float) -> fx.GraphModule:
    """Every mixture-of-experts block of ``gm`` with capacity factor ``cf`` (see the module)."""
    check_capacity_factor(cf)
    blocks = find_experts(gm)
    if not blocks:
        raise ExpertParallelError(f"parallelize(moe_capacity_factor={cf}): the model has no mixture-of-experts block "
                                  "(no matmul over a parameter with an experts dim, docs/EXPERT_PARALLEL.md): leave "
                                  "it at None")
    for b in blocks:
        _mask_block(gm, b, cf)
    gm.graph.lint()
    gm.recompile()
    return gm
