"""Tensor parallelism at tp=world against the unmodified model."""
import copy

import torch

from tests import models
from tests.workers.common import side_by_side, tp_mesh


def tp_parity(rank, world, names, steps=3, parallel_kwargs=None):
    """For each model: loss and gradients of the first step, then ``steps`` AdamW losses,
    for the unmodified model and fxmegatron at tp=world."""
    import fxmegatron

    mesh = tp_mesh(world)
    out = {}
    for name in names:
        model = models.build(name)
        ref = copy.deepcopy(model)
        pm = fxmegatron.parallelize(model, mesh, models.batch(name), **(parallel_kwargs or {}))
        r = side_by_side(pm, ref, lambda i: models.batch(name, seed=i), steps)
        from fxmegatron.ops.overlapped_linear import gathered_linears, scattered_linear
        merged = [n.target.__name__ for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.op == "call_function" and n.target in (gathered_linears, scattered_linear)]
        from fxmegatron.io.dump import collective_nodes
        listed = [k for _, k in collective_nodes(pm.graph_module)]
        merged_linears = [n.meta["merged_linears"] for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
                          for n in m.graph.nodes if "merged_linears" in n.meta]
        out[name] = {**r, "merged": merged, "merged_linears": merged_linears,
                     "listed": listed,
                     "n_local": sum(p.numel() for p in pm.parameters()),
                     "n_full": sum(p.numel() for p in ref.parameters())}
    return out
