"""Move a set of nodes into a submodule called in their place (used by recompute and fuse)."""
from __future__ import annotations

import operator
from typing import Callable, List, Sequence, Tuple

import torch.fx as fx
import torch.nn as nn


def boundary(nodes: Sequence[fx.Node]) -> Tuple[List[fx.Node], List[fx.Node]]:
    """(values the nodes read from outside, nodes whose values are used outside), in order."""
    members = set(nodes)
    inputs: List[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    return inputs, outputs


def outline(gm: fx.GraphModule, nodes: Sequence[fx.Node], name: str,
            make: Callable[[fx.GraphModule, List[fx.Node], List[fx.Node]], nn.Module], meta: dict) -> fx.Node:
    """Replace ``nodes`` by ``call_module(name)`` of ``make(body, inputs, outputs)``, where ``body``
    is a GraphModule of the nodes returning the tuple of ``outputs``. The call is placed at the
    last node, so nodes in between that do not use the moved values may stay where they are."""
    inputs, outputs = boundary(nodes)
    sub = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, make(fx.GraphModule(gm, sub), inputs, outputs))
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta.update(meta)
    call.meta["nn_module_stack"] = nodes[0].meta.get("nn_module_stack")
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    with gm.graph.inserting_after(call):
        for i, o in enumerate(outputs):
            get = gm.graph.call_function(operator.getitem, (call, i))
            get.meta = dict(o.meta)
            o.replace_all_uses_with(get)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return call
