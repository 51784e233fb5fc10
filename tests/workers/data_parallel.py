"""Data parallelism (with tp and pp): parity, bucketed overlap and ZeRO-1, gradient clipping,
fp32 gradient accumulation."""
import copy

import torch

from tests import models
from tests.workers.common import mesh_3d, train_side_by_side


def dp_parity(rank, world, layout, names, steps=5, n_layer=4, batch_size=8, parallel_kwargs=None):
    """Losses of ``steps`` AdamW steps at (dp, pp, tp) = layout, next to the unmodified model's,
    and the first step's gradient errors of this rank's parameters."""
    import fxmegatron

    mesh = mesh_3d(*layout)
    out = {}
    for name in names:
        model = models.build(name, n_layer=n_layer)
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=batch_size),
                                    **(parallel_kwargs or {}))
        out[name] = train_side_by_side(pm, copy.deepcopy(model), name, steps, batch_size)
    return out


def dp_overlap_and_zero(rank, world, steps=3):
    """dp=world: small gradient buckets (reduced during backward), then ZeRO-1 (optimizer state
    sharded over dp with torch's ZeroRedundancyOptimizer): losses next to the unmodified model's."""
    import fxmegatron
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from fxmegatron.runtime.data_parallel import GradSync

    mesh = mesh_3d(world, 1, 1)
    name = "gpt"
    model = models.build(name, n_layer=2)
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=8))
    pm._grad_sync.remove()
    pm._grad_sync = GradSync(list(pm.parameters()), {}, pm.dp_group, world, bucket_mb=0.02)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = ZeroRedundancyOptimizer(list(pm.parameters()), optimizer_class=torch.optim.AdamW,
                                  process_group=pm.dp_group, lr=1e-3)
    losses, losses_ref = [], []
    for step in range(steps):
        b = models.batch(name, seed=step, batch_size=8)
        lr_ = models.call(ref, b)
        lr_.backward()
        losses_ref.append(lr_.item())
        losses.append(pm.train_step(b).item())
        opt_ref.step(); opt_ref.zero_grad()
        opt.step(); opt.zero_grad()
    local_state = sum(t.numel() for st in opt.optim.state.values() for t in st.values() if torch.is_tensor(t))
    return {"losses": losses, "losses_ref": losses_ref, "buckets": len(pm._grad_sync.buckets),
            "early": pm._grad_sync.launched_in_backward, "state_numel": local_state,
            "param_numel": sum(p.numel() for p in pm.parameters())}


def clip_parity(rank, world, layout, name="gpt", steps=3, max_norm=0.05):
    """clip_grad_norm_ at (dp, pp, tp): the norm and the clipped steps' losses next to
    torch.nn.utils.clip_grad_norm_ on the unmodified model."""
    import fxmegatron

    model = models.build(name, n_layer=4)
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(copy.deepcopy(model), mesh_3d(*layout), models.batch(name, batch_size=8),
                                microbatches=2 if layout[1] > 1 else 1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        b = models.batch(name, seed=step, batch_size=8)
        lr_ = models.call(ref, b)
        lr_.backward()
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
        loss = pm.train_step(b).item()
        n = pm.clip_grad_norm_(max_norm).item()
        out.append((loss, lr_.item(), n, n_ref))
        opt_ref.step(); opt_ref.zero_grad()
        opt.step(); opt.zero_grad()
    return out


def grad_accum_errors(rank, world, layout, microbatches, n_layer=4, batch_size=16, dp_shard="none"):
    """The first step's gradients of a bf16 model at (dp, pp, tp) = layout over ``microbatches``,
    accumulated by autograd (bf16) and in fp32 (``grad_accum_dtype``), each against the
    unmodified model in float64: {accumulation: ||g - g64|| / ||g64|| over all parameters}."""
    import fxmegatron

    mesh = mesh_3d(*layout)
    model = models.build("gpt", n_layer=n_layer)
    b = models.batch("gpt", batch_size=batch_size)
    ref = copy.deepcopy(model).double()
    models.call(ref, b).backward()
    out = {}
    for accum in (None, torch.float32):
        pm = fxmegatron.parallelize(copy.deepcopy(model).to(torch.bfloat16), mesh, b, microbatches=microbatches,
                                    grad_accum_dtype=accum, dp_shard=dp_shard)
        pm.train_step(b)
        full = pm.full_grads()
        num = sum(((full[n].double() - p.grad) ** 2).sum().item() for n, p in ref.named_parameters() if n in full)
        den = sum((p.grad ** 2).sum().item() for n, p in ref.named_parameters() if n in full)
        missing = [n for n, _ in pm.named_parameters() if n not in full]
        out[str(accum)] = {"err": (num / den) ** 0.5, "n": len(full), "missing": missing}
    return out
