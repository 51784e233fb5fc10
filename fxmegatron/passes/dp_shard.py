"""``dp_shard="full"`` (ZeRO-3, fully sharded data parallelism) as a graph transformation.

Every parameter of the rank's graph becomes its data-parallel shard (``ops.dp_gather``: this
rank's piece of the flattened, padded tensor-parallel piece), and an ``unshard`` node puts the
parameters of one transformer block together right before the block's first op: one
all-gather per block, one reduce-scatter of its gradients in the backward. The parameters of
one block (the outermost module path ending in an index, as recomputation finds blocks) form a
group; a parameter read outside any block, or by several blocks (a tied embedding and LM head),
is a group of its own, gathered before its first reader.

How the whole parameters are dropped between forward and backward:

* ``recompute="full"``: the ``unshard`` node carries the block's module path, so it falls inside
  the block's recomputed region; the region keeps only its inputs (the shards) and gathers again
  when it recomputes in the backward.
* ``compile=True`` otherwise: the node asks for its gather to be recomputed
  (``recompute_gather``), and the compiled backward gathers again where it needs the weights.
* eager otherwise: what autograd saves of a whole parameter is kept as a reference to its
  shards, and the backward gathers the group again (``ops.dp_gather.regather_in_backward``,
  around each forward of ``ParallelModel.train_step``).

Preconditions: local shapes (after the tensor-parallel rewrite and ``localize``); before
``recompute``. ``gm.meta[DP_SHARD]`` names each sharded parameter with its local shape, for
materialisation.
"""
from __future__ import annotations

import operator
from typing import Collection, Dict, List

import torch
import torch.fx as fx
import torch.nn as nn

from fxmegatron.ops.dp_gather import shard_length, unshard
from fxmegatron.passes.recompute import block_of

DP_SHARD = "fxmegatron/dp_shard"     # gm.meta: parameter name -> its local (tensor-parallel) shape


def _set_param(gm: fx.GraphModule, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(gm.get_submodule(owner) if owner else gm, leaf, value)


def shard_parameters(gm: fx.GraphModule, params: Collection[str], world: int, divisor: int, group_name: str,
                     recompute_gather: bool) -> fx.GraphModule:
    """Shard every parameter in ``params`` over a group of ``world`` ranks named ``group_name``
    and gather each block's before the block (see the module's docstring)."""
    if world == 1:
        return gm
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    attrs: Dict[str, List[fx.Node]] = {}
    for n in nodes:
        if n.op == "get_attr" and n.target in params and n.users:
            attrs.setdefault(n.target, []).append(n)
    groups: Dict[str, List[str]] = {}
    first: Dict[str, fx.Node] = {}
    for name, gets in attrs.items():
        users = sorted({u for g in gets for u in g.users}, key=order.__getitem__)
        blocks = {block_of(u) for u in users}
        key = next(iter(blocks)) if len(blocks) == 1 and "" not in blocks else "param:" + name
        groups.setdefault(key, []).append(name)
        if key not in first or order[users[0]] < order[first[key]]:
            first[key] = users[0]
    shapes: Dict[str, tuple] = {}
    for key, names in groups.items():
        at = first[key]
        local = [gm.get_parameter(n) for n in names]
        got: List[fx.Node] = []
        for name, p in zip(names, local):
            s = shard_length(p.numel(), world)
            _set_param(gm, name, nn.Parameter(torch.empty(s, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad))
            shapes[name] = tuple(p.shape)
            gets = attrs[name]
            for g in gets[1:]:
                g.replace_all_uses_with(gets[0])
                gm.graph.erase_node(g)
            at.prepend(gets[0])
            old = gets[0].meta.get("val")
            gets[0].meta["val"] = old.new_empty((s,)) if old is not None else None
            got.append(gets[0])
        with gm.graph.inserting_before(at):
            call = gm.graph.call_function(unshard, ([*got], [list(shapes[n]) for n in names], world, divisor,
                                                    group_name, recompute_gather))
            outs = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(names))]
        for node in [call, *outs]:
            node.meta["nn_module_stack"] = dict(at.meta.get("nn_module_stack") or {})
            node.meta["dp_shard"] = key
        for g, out, p in zip(got, outs, local):
            old = g.meta.get("val")
            if old is not None:
                out.meta["val"] = old.new_empty(p.shape)
            g.replace_all_uses_with(out, delete_user_cb=lambda u: u is not call)
    gm.meta[DP_SHARD] = shapes
    gm.graph.lint()
    gm.recompile()
    return gm
