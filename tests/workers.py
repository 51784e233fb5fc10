"""Functions run on each gloo process by the multi-process tests (importable by spawn)."""
import copy

import torch

from tests import models


def rel_err(a, b, scale=0.0):
    """max |a-b| relative to max |b|. ``scale`` (1% of the largest gradient of the model) is a
    floor for tensors whose gradient is zero in exact arithmetic, such as a key bias (softmax
    ignores a per-query shift), where any relative error is rounding noise over rounding noise."""
    return ((a - b).abs().max() / max(b.abs().max().item(), scale, 1e-30)).item()


def tp_mesh(world):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


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
        out[name] = {"losses_ref": losses_ref, "losses": losses, "grad_err": grad_err,
                     "n_local": sum(p.numel() for p in pm.parameters()),
                     "n_full": sum(p.numel() for p in ref.parameters())}
    return out


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


def dropout_runs(rank, world, names, layouts, steps=2, p=0.1):
    """With dropout ``p``: losses and first-step gradients of fxmegatron at tp=world for each
    (sequence_parallel, recompute) layout, and of fxmegatron on one process (tp=1)."""
    import fxmegatron

    mesh = tp_mesh(world)
    out = {}
    for name in names:
        model = models.build(name, dropout=p)
        single = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name), seed=5)
        out[name] = {"single": _run_steps(single, name, steps)}
        for sp, rc in layouts:
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name), seed=5,
                                        sequence_parallel=sp, recompute=rc)
            out[name][(sp, rc)] = _run_steps(pm, name, steps)
    return out


def pp_mesh(world, pp):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "tp"))


def pipeline_parity(rank, world, pp, names, configs, n_layer=8, batch_size=8, steps=2, extra=None):
    """For each model and (schedule, virtual_stages, microbatches): losses of ``steps`` AdamW steps
    and first-step gradients (this rank's parameters) of fxmegatron at (pp, tp=world/pp), next to
    the unmodified model's."""
    import fxmegatron

    mesh = pp_mesh(world, pp)
    out = {}
    for name in names:
        model = models.build(name, n_layer=n_layer)
        for sched, v, m in configs:
            ref = copy.deepcopy(model)
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=batch_size),
                                        microbatches=m, virtual_stages=v, schedule=sched, **(extra or {}))
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            losses, losses_ref, grad_err = [], [], {}
            for step in range(steps):
                b = models.batch(name, seed=step, batch_size=batch_size)
                lr_ = models.call(ref, b)
                lr_.backward()
                loss = pm.train_step(b)
                losses_ref.append(lr_.item())
                losses.append(loss.item())
                if step == 0:
                    full = pm.full_grads()
                    scale = 0.01 * max(p.grad.abs().max().item() for p in ref.parameters())
                    grad_err = {n: rel_err(full[n], p.grad, scale) for n, p in ref.named_parameters() if n in full}
                opt_ref.step(); opt_ref.zero_grad()
                opt.step(); opt.zero_grad()
            out[(name, sched, v, m)] = {"losses": losses, "losses_ref": losses_ref, "grad_err": grad_err}
    return out


def pipeline_failure(rank, world, fail_rank, microbatches=4):
    """Pipeline rank ``fail_rank`` raises in its third chunk call; every rank returns
    (exception type, message, seconds from the start of train_step to the exception)."""
    import time

    import fxmegatron

    mesh = pp_mesh(world, world)
    name = "gpt"
    pm = fxmegatron.parallelize(models.build(name, n_layer=4), mesh, models.batch(name, batch_size=8),
                                microbatches=microbatches)
    runner = pm._pipeline.runner
    if pm.pp_rank == fail_rank:
        (c, chunk), = runner.chunks.items()
        calls = []

        def sabotaged(*args):
            calls.append(1)
            if len(calls) == 3:
                raise ValueError(f"injected failure in chunk {c}")
            return chunk(*args)

        runner.chunks[c] = sabotaged
    t0 = time.time()
    try:
        pm.train_step(models.batch(name, batch_size=8))
        return ("none", "", time.time() - t0)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.time() - t0)
