"""Dropout (counter-based RNG) at tp=world, with sequence parallelism and recomputation, against
one process."""
import copy

import torch

from tests import models
from tests.workers.common import tp_mesh


def _run_steps(pm, name, steps):
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, grads = [], None
    for step in range(steps):
        loss = pm(models.batch(name, seed=step))
        loss.backward()
        losses.append(loss.detach().clone())
        if step == 0:
            grads = pm.full_grads()
        opt.step(); opt.zero_grad()
    return losses, grads


def dropout_single(names, steps=2, p=0.1):
    """Losses and first-step gradients of fxmegatron on one process (tp=1) with dropout ``p``: the
    reference every tp layout equals. A function of the model alone: the parent computes it once."""
    import fxmegatron

    out = {}
    for name in names:
        model = models.build(name, dropout=p)
        out[name] = _run_steps(fxmegatron.parallelize(model, None, models.batch(name), seed=5), name, steps)
    return out


def dropout_runs(rank, world, names, layouts, steps=2, p=0.1, extra=None, single=True):
    """With dropout ``p``: losses and first-step gradients of fxmegatron at tp=world for each
    (sequence_parallel, recompute) layout (with ``extra`` keywords), and (``single``) of
    fxmegatron on one process (tp=1, no extra keywords)."""
    import fxmegatron

    mesh = tp_mesh(world)
    out = {}
    for name in names:
        model = models.build(name, dropout=p)
        out[name] = {}
        if single:
            out[name]["single"] = _run_steps(fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name),
                                                                    seed=5), name, steps)
        for sp, rc in layouts:
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name), seed=5,
                                        sequence_parallel=sp, recompute=rc, **(extra or {}))
            out[name][(sp, rc)] = _run_steps(pm, name, steps)
    return out
