"""``dp_shard="full"`` (ZeRO-3, fully sharded data parallelism) as a graph transformation.

Every parameter of the rank's graph becomes its data-parallel shard (``ops.dp_gather``: this
rank's piece of the flattened, padded tensor-parallel piece), and an ``unshard`` node puts the
parameters of one transformer block together right before the block's first op: one
all-gather per block, one reduce-scatter of its gradients in the backward. The parameters of
one block (the outermost module path ending in an index, as recomputation finds blocks) form a
group; a parameter read outside any block, or by several blocks (a tied embedding and LM head),
is a group of its own, gathered before its first reader. With ``per_use`` (a pipeline, whose
chunks are cut at blocks after this pass) such a parameter is gathered again before each
reader instead, so that every gather lies in its reader's chunk and no whole weight crosses a
stage boundary: the shard is then a weight several chunks read, like any tied weight.

How the whole parameters are dropped between forward and backward:

* ``recompute="full"``: the ``unshard`` node carries the block's module path, so it falls inside
  the block's recomputed region; the region keeps only its inputs (the shards) and gathers again
  when it recomputes in the backward.
* ``compile=True`` otherwise: the node asks for its gather to be recomputed
  (``recompute_gather``), and the compiled backward gathers again where it needs the weights.
* eager otherwise: what autograd saves of a whole parameter is kept as a reference to its
  shards, and the backward gathers the group again (``ops.dp_gather.regather_in_backward``,
  around each forward of ``ParallelModel.train_step``).

Expert parallelism (``apart``): an expert weight the ep pass cut to E/ep is held by fewer ranks
than the dense weights (the "edp" group: dp / ep × cp, the ranks holding the same experts), so it
is sharded, gathered and reduce-scattered over that group: a block's parameters then form one
group per collective group, each with its own ``unshard``, as torchtitan shards experts over its
expert-data-parallel mesh.

Preconditions: local shapes (after the tensor-parallel rewrite and ``localize``); before
``recompute``. ``gm.meta[DP_SHARD]`` names each sharded parameter with its local shape, for
materialisation.
"""
from __future__ import annotations

import operator
from typing import Collection, Dict, List, Mapping, Optional, Tuple

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
                     recompute_gather: bool, per_use: bool = False, functional: bool = False,
                     replicate_group: str = "",
                     apart: Optional[Mapping[str, Tuple[int, str]]] = None) -> fx.GraphModule:
    """Shard every parameter in ``params`` over a group of ``world`` ranks named ``group_name``
    and gather each block's before the block (see the module's docstring). ``functional``: the
    gathers are torch's functional collectives, which inductor's overlap scheduler moves
    (``ops.dp_gather``). ``replicate_group``: under hybrid sharding, the group of the ranks that
    hold the same shards in the other replica groups, over which the reduced shards are summed.
    ``apart``: parameter -> (world, group name) for those sharded over another group (expert
    parallelism's experts over "edp"); a block gathers them in an ``unshard`` of their own."""
    apart = apart or {}
    if world == 1 and not apart:
        return gm
    over = {name: apart.get(name, (world, group_name)) for name in params}
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    attrs: Dict[str, List[fx.Node]] = {}
    for n in nodes:
        if n.op == "get_attr" and n.target in params and n.users:
            attrs.setdefault(n.target, []).append(n)
    groups: Dict[str, List[str]] = {}
    first: Dict[str, fx.Node] = {}
    only: Dict[str, fx.Node] = {}       # a per-use group: the one reader it is gathered for
    for name, gets in attrs.items():
        users = sorted({u for g in gets for u in g.users}, key=order.__getitem__)
        blocks = {block_of(u) for u in users}
        if len(blocks) == 1 and "" not in blocks:
            # a block's parameters sharded over another group (experts) form a gather of their own
            keys = [(next(iter(blocks)) + (f" over {apart[name][1]}" if name in apart else ""), users[0])]
        elif per_use and len(users) > 1:
            keys = [(f"param:{name}@{u.name}", u) for u in users]
            only.update({k: u for k, u in keys})
        else:
            keys = [("param:" + name, users[0])]
        for key, u in keys:
            groups.setdefault(key, []).append(name)
            if key not in first or order[u] < order[first[key]]:
                first[key] = u
    shapes: Dict[str, tuple] = {}
    for name in attrs:
        p = gm.get_parameter(name)
        shapes[name] = tuple(p.shape)
        s = shard_length(p.numel(), over[name][0])
        _set_param(gm, name, nn.Parameter(torch.empty(s, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad))
        for g in attrs[name]:
            old = g.meta.get("val")
            g.meta["val"] = old.new_empty((s,)) if old is not None else None
    for key, names in groups.items():
        at = first[key]
        size, group = over[names[0]]      # every name of a group is sharded over the same ranks
        got: List[fx.Node] = []
        for name in names:
            gets = attrs[name]
            if key in only:         # a get_attr of its own, read by this gather alone
                with gm.graph.inserting_before(at):
                    mine = gm.graph.get_attr(name)
                mine.meta = dict(gets[0].meta)
                got.append(mine)
                continue
            for g in gets[1:]:
                g.replace_all_uses_with(gets[0])
                gm.graph.erase_node(g)
            at.prepend(gets[0])
            got.append(gets[0])
        with gm.graph.inserting_before(at):
            call = gm.graph.call_function(unshard, ([*got], [list(shapes[n]) for n in names], size, divisor,
                                                    group, recompute_gather, functional, replicate_group))
            outs = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(names))]
        for node in [call, *outs]:
            node.meta["nn_module_stack"] = dict(at.meta.get("nn_module_stack") or {})
            node.meta["dp_shard"] = key
        for g, out, name in zip(got, outs, names):
            old = g.meta.get("val")
            if old is not None:
                out.meta["val"] = old.new_empty(shapes[name])
            if key in only:         # the reader alone reads the whole weight from this gather
                for a in [a for a in only[key].all_input_nodes if a.op == "get_attr" and a.target == name]:
                    only[key].replace_input_with(a, out)
            else:
                g.replace_all_uses_with(out, delete_user_cb=lambda u: u is not call)
        # the gather's value, as the pipeline split reads it (which values carry a gradient)
        vals = [o.meta.get("val") for o in outs]
        call.meta["val"] = vals if all(v is not None for v in vals) else None
    per_use_names = {n for key, names in groups.items() if key in only for n in names}
    for name in per_use_names:      # the get_attrs the per-use gathers took every reader from
        for g in attrs[name]:
            if not g.users:
                gm.graph.erase_node(g)
    gm.meta[DP_SHARD] = shapes
    gm.graph.lint()
    gm.recompile()
    return gm
