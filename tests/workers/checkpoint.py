"""Checkpoints: save and resume at a layout, the full state dict back into the unmodified model."""
import copy

import torch

from tests import models
from tests.workers.common import mesh_3d


def ckpt_run(rank, world, layout, steps, first_step=0, load_dir=None, save_dir=None, dropout=0.0,
             name="gpt", microbatches=2, fused_adam=False):
    """Train ``steps`` AdamW steps (``fused_adam``: fxmegatron's FusedAdamW) at layout (dp, pp,
    tp) from step ``first_step`` (batches are seeded by the step), loading from / saving to a
    checkpoint; returns the losses (floats)."""
    import fxmegatron
    from fxmegatron.io import checkpoint

    dp, pp, tp = layout
    mesh = mesh_3d(dp, pp, tp)
    model = models.build(name, dropout=dropout, n_layer=4)
    pm = fxmegatron.parallelize(model, mesh, models.batch(name, batch_size=8), seed=3,
                                microbatches=microbatches if pp > 1 else 1)
    # the rank's coordinate on every axis, as the mesh has it (cp absent: 0 of 1)
    at = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    assert pm.coords() == {"dp": at["dp"], "pp": at["pp"], "cp": 0, "tp": at["tp"]}, pm.coords()
    assert pm.degrees() == {"dp": dp, "pp": pp, "cp": 1, "tp": tp}, pm.degrees()
    sched = None
    if fused_adam:      # as a training script sets it up: no decay on biases and norms, a schedule
        from fxmegatron.optim import FusedAdamW
        params = list(pm.parameters())
        opt = FusedAdamW([{"params": [p for p in params if p.dim() > 1]},
                          {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    else:
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    if load_dir:
        extra = checkpoint.load(pm, opt, load_dir)
        if sched is not None:
            sched.load_state_dict(extra["sched"])
    losses = []
    for step in range(first_step, first_step + steps):
        losses.append(pm.train_step(models.batch(name, seed=step, batch_size=8)).item())
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    if save_dir:
        extra = {"step": first_step + steps}
        if sched is not None:
            extra["sched"] = sched.state_dict()
        checkpoint.save(pm, opt, save_dir, extra=extra)
    return losses


def full_state_roundtrip(rank, world, layout, name, tmp):
    """full_state_dict at (dp, pp, tp) after one step; rank 0 loads it into the unmodified model
    (strict) and, for HF models, round-trips it through save_pretrained / from_pretrained."""
    import fxmegatron

    mesh = mesh_3d(*layout)
    model = models.build(name, n_layer=4)
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(model, mesh, models.batch(name, batch_size=8),
                                microbatches=2 if layout[1] > 1 else 1)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.train_step(models.batch(name, batch_size=8))
    opt.step()
    full = pm.full_state_dict()
    b = models.batch(name, seed=9, batch_size=8)
    loss_parallel = pm.train_step(b).item()
    if rank != 0:
        return None
    ref.load_state_dict(full, strict=True)
    loss = models.call(ref, b).item()
    out = {"loss_loaded": loss, "loss_parallel": loss_parallel, "n": len(full)}
    if hasattr(ref, "save_pretrained"):
        ref.save_pretrained(tmp)
        back = type(ref).from_pretrained(tmp)
        back.train()
        out["loss_roundtrip"] = models.call(back, b).item()
        out["equal"] = all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    return out


def sharded_save(rank, world, mode, replicate, directory):
    """Two AdamW steps at dp ``world`` with ``dp_shard=mode`` (``replicate`` replica groups), then
    a save during which no rank may gather (torch.distributed's gathers and broadcasts raise);
    returns this rank's whole parameters (``full_state_dict``, after the save) and, per
    parameter, the numel this rank holds of it and of its optimizer state."""
    import torch.distributed as dist

    import fxmegatron
    from fxmegatron.io import checkpoint
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = models.build("gpt", n_layer=2)
    pm = fxmegatron.parallelize(model, mesh, models.batch("gpt", batch_size=8), dp_shard=mode,
                                dp_replicate=replicate)
    opt = pm.adamw(lr=1e-3)
    for step in range(2):
        pm.train_step(models.batch("gpt", batch_size=8, seed=step))
        opt.step()
        opt.zero_grad()

    def refuse(*a, **k):
        raise AssertionError("a collective that gathers ran during save")
    saved = {f: getattr(dist, f) for f in ("all_gather", "all_gather_into_tensor", "gather", "broadcast",
                                           "all_reduce", "all_gather_object")}
    for f in saved:
        setattr(dist, f, refuse)
    try:
        checkpoint.save(pm, opt, directory)
    finally:
        for f, fn in saved.items():
            setattr(dist, f, fn)
    return {n: t.clone() for n, t in pm.full_state_dict().items()}
