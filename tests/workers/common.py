"""What the workers share: the relative error, the meshes, and training fxmegatron next to
the unmodified model."""
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


def pp_mesh(world, pp):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "tp"))


def mesh_3d(dp, pp, tp):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


def train_side_by_side(pm, ref, name, steps, batch_size):
    """``steps`` AdamW steps of ``pm.train_step`` and of the unmodified ``ref`` on the same
    batches: both loss lists and the first step's gradient errors of this rank's parameters."""
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, losses_ref, grad_err = [], [], {}
    for step in range(steps):
        b = models.batch(name, seed=step, batch_size=batch_size)
        lr_ = models.call(ref, b)
        lr_.backward()
        losses_ref.append(lr_.item())
        losses.append(pm.train_step(b).item())
        if step == 0:
            full = pm.full_grads()
            scale = 0.01 * max(p.grad.abs().max().item() for p in ref.parameters())
            grad_err = {n: rel_err(full[n], p.grad, scale) for n, p in ref.named_parameters() if n in full}
        opt_ref.step(); opt_ref.zero_grad()
        opt.step(); opt.zero_grad()
    return {"losses": losses, "losses_ref": losses_ref, "grad_err": grad_err}
