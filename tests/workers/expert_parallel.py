"""Workers of tests/test_expert_parallel.py: MoE models at ep > 1 against the unmodified model,
step by step, on gloo."""
import copy

import torch

from tests import models
from tests.workers.sharded_dp import _mesh, _model_and_batches


def ep_parity(rank, world, dims, names, kw, steps=3):
    """``steps`` SGD steps on different batches with masked labels at mesh ``dims`` and
    ``parallelize``'s keywords ``kw`` (``ep`` among them), next to the same on the unmodified
    model: per model and step the two losses and, per parameter, the largest
    difference of the whole gradients over the reference's largest magnitude; and the local
    shapes of the expert weights."""
    import fxmegatron

    mesh = _mesh(dims)
    out = {}
    for name in names:
        model, batch = _model_and_batches(name)
        ref = copy.deepcopy(model)
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, batch(0), **kw)
        # SGD: AdamW's step is about lr whatever the gradient's size, so the rounding of a near-zero
        # gradient moves a weight by lr (dp alone shows 1e-4 after one step of it); SGD's moves it by
        # the rounding, and each step's gradients are compared at (nearly) the same weights
        opt = torch.optim.SGD(pm.parameters(), lr=0.5)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
        losses, losses_ref, errs = [], [], []
        for step in range(steps):
            b = batch(10 + step)
            labels = b[1] if isinstance(b, tuple) else b["labels"]
            labels[step % 8, : 3 + step] = -100
            loss_ref = models.call(ref, b)
            loss_ref.backward()
            losses_ref.append(loss_ref.item())
            losses.append(pm.train_step(b).item())
            grads = pm.full_grads()
            err = {}
            for n, w in ref.named_parameters():
                if n in grads and w.grad is not None:
                    err[n] = ((grads[n] - w.grad).abs().max() / w.grad.abs().max().clamp_min(1e-30)).item()
            errs.append(err)
            opt_ref.step()
            opt_ref.zero_grad()
            opt.step()
            pm.zero_grad()
        out[name] = {"losses": losses, "losses_ref": losses_ref, "errs": errs,
                     "experts": {n: tuple(p.shape) for n, p in pm.named_parameters() if n in pm.program.experts},
                     "whole": {n: tuple(p.shape) for n, p in model.named_parameters() if n in pm.program.experts}}
    return out
