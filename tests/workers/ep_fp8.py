"""Worker of tests/test_expert_parallel.py's FP8 test: an MoE at dp, with and without ep, in FP8."""
import copy

import torch

from fxmegatron.capture import module_path
from tests.workers.sharded_dp import _mesh, _model_and_batches, step_batch


def ep_against_dp(rank, world, name, kw, steps=3):
    """``steps`` SGD steps of the model at dp ``world`` (ep 1) and at dp ``world`` × ep 2, both
    with parallelize's keywords ``kw``, on the same batches: the two runs' losses and, per step,
    each parameter's largest whole-gradient difference over the ep-1 run's largest magnitude, and
    which linears ran in FP8 (the ep run's report)."""
    import fxmegatron
    model, batch = _model_and_batches(name)
    runs = {}
    for ep in (1, 2):
        pm = fxmegatron.parallelize(copy.deepcopy(model), _mesh({"dp": world}), batch(0), ep=ep, **kw)
        opt = torch.optim.SGD(pm.parameters(), lr=0.5)
        losses, grads = [], []
        for step in range(steps):
            losses.append(pm.train_step(step_batch(batch, step)).item())
            grads.append({n: g.clone() for n, g in pm.full_grads().items()})
            opt.step()
            pm.zero_grad()
        runs[ep] = (losses, grads, pm)
    errs = [{n: ((g2[n] - g1[n]).abs().max() / g1[n].abs().max().clamp_min(1e-30)).item() for n in g1}
            for g1, g2 in zip(runs[1][1], runs[2][1])]
    fp8 = [module_path(n) for n in runs[2][2].graph_module.graph.nodes       # fp8_linear, or its shared-operand form
           if getattr(n.target, "__name__", "").startswith("fp8_linear")]
    return {"losses": (runs[1][0], runs[2][0]), "errs": errs, "fp8": fp8}
