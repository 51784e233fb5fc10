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


def _forward_backward(pm, b):
    loss = pm(b)
    loss.backward()
    return loss


def side_by_side(pm, ref, batch, steps, lr=1e-3, step=_forward_backward, local_only=False):
    """``steps`` AdamW steps of fxmegatron (``step(pm, b)``: forward and backward, returns the
    loss) and of the unmodified ``ref`` on the same batches ``batch(i)``: both loss lists and the
    first step's gradient error of each parameter (inf where fxmegatron has none, unless
    ``local_only``: a pipeline rank holds only its stages' parameters)."""
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses, losses_ref, grad_err = [], [], {}
    for i in range(steps):
        b = batch(i)
        loss_ref = models.call(ref, b)
        loss_ref.backward()
        losses_ref.append(loss_ref.item())
        losses.append(step(pm, b).item())
        if i == 0:
            full = pm.full_grads()
            grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            scale = 0.01 * max(g.abs().max().item() for g in grads.values())
            grad_err = {n: rel_err(full[n], g, scale) if n in full else float("inf")
                        for n, g in grads.items() if n in full or not local_only}
        opt_ref.step(); opt_ref.zero_grad()
        opt.step(); opt.zero_grad()
    return {"losses": losses, "losses_ref": losses_ref, "grad_err": grad_err}


def train_side_by_side(pm, ref, name, steps, batch_size):
    """``side_by_side`` of ``pm.train_step`` on the test models' batches."""
    return side_by_side(pm, ref, lambda i: models.batch(name, seed=i, batch_size=batch_size), steps,
                        step=lambda pm, b: pm.train_step(b), local_only=True)


def preload_state(rank, world):
    """What a gloo worker finds imported when it starts (tests/distributed.py's forkserver)."""
    import sys
    was = sys.modules.get("tests.worker_preload")
    return {"preloaded": was is not None, "failed": list(was.FAILED) if was else None,
            "transformers": "transformers" in sys.modules, "gpt": "gpt" in sys.modules}
