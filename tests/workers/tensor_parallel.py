"""Tensor parallelism at tp=world against the unmodified model."""
import copy

import torch

from tests import models
from tests.workers.common import rel_err, tp_mesh


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
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        losses_ref, losses, grad_err = [], [], {}
        for step in range(steps):
            b = models.batch(name, seed=step)
            lr_ = models.call(ref, b)
            lr_.backward()
            lp = pm(b)
            lp.backward()
            losses_ref.append(lr_.item())
            losses.append(lp.item())
            if step == 0:
                full = pm.full_grads()
                scale = 0.01 * max(p.grad.abs().max().item() for p in ref.parameters())
                for n, p in ref.named_parameters():
                    grad_err[n] = rel_err(full[n], p.grad, scale) if n in full else float("inf")
            opt_ref.step(); opt_ref.zero_grad()
            opt.step(); opt.zero_grad()
        from fxmegatron.ops.overlapped_linear import gathered_linears, scattered_linear
        merged = [n.target.__name__ for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.op == "call_function" and n.target in (gathered_linears, scattered_linear)]
        from fxmegatron.io.dump import collective_nodes
        listed = [k for _, k in collective_nodes(pm.graph_module)]
        out[name] = {"losses_ref": losses_ref, "losses": losses, "grad_err": grad_err, "merged": merged,
                     "listed": listed,
                     "n_local": sum(p.numel() for p in pm.parameters()),
                     "n_full": sum(p.numel() for p in ref.parameters())}
    return out
