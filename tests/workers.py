"""Functions run on each gloo (or NCCL) process by the multi-process tests (importable by spawn)."""
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


def dropout_runs(rank, world, names, layouts, steps=2, p=0.1, extra=None):
    """With dropout ``p``: losses and first-step gradients of fxmegatron at tp=world for each
    (sequence_parallel, recompute) layout (with ``extra`` keywords), and of fxmegatron on one
    process (tp=1, no extra keywords)."""
    import fxmegatron

    mesh = tp_mesh(world)
    out = {}
    for name in names:
        model = models.build(name, dropout=p)
        single = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name), seed=5)
        out[name] = {"single": _run_steps(single, name, steps)}
        for sp, rc in layouts:
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name), seed=5,
                                        sequence_parallel=sp, recompute=rc, **(extra or {}))
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
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=batch_size),
                                        microbatches=m, virtual_stages=v, schedule=sched, **(extra or {}))
            out[(name, sched, v, m)] = train_side_by_side(pm, copy.deepcopy(model), name, steps, batch_size)
    return out


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


def mesh_3d(dp, pp, tp):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


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


def inprocess_lm_losses(rank, world, layout, steps, microbatches=2, lr=1e-3):
    """The factory model through parallelize() in-process, on fxmegatron.launch's batches."""
    import os
    import sys

    import fxmegatron
    from fxmegatron.launch import lm_batch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "factories"))
    import gpt_small

    dp, pp, tp = layout
    model, _ = gpt_small.build()
    rows = gpt_small.ROWS * dp
    pm = fxmegatron.parallelize(model, mesh_3d(dp, pp, tp), lm_batch(None, 0, rows, gpt_small.SEQ),
                                microbatches=microbatches)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        losses.append(pm.train_step(lm_batch(None, step, rows, gpt_small.SEQ)).item())
        opt.step()
        opt.zero_grad()
    return losses


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


def pipeline_boundaries(rank, world, name="gpt", n_layer=4):
    """Number of tensors each chunk sends on, at pp2 x tp2, interleaved, sequence parallel."""
    import fxmegatron

    pm = fxmegatron.parallelize(models.build(name, n_layer=n_layer), pp_mesh(world, 2),
                                models.batch(name, batch_size=4), sequence_parallel=True, microbatches=2,
                                virtual_stages=2, schedule="interleaved")
    return [len(c.boundary_out) for c in pm._pipeline.chunks]


def copy_engine_vs_nccl(rank, world):
    """The overlapped linears over copy engines and over NCCL, both in fp32, against the same ops
    over NCCL in fp64, forward and backward: the gather with three linears of one input (biases;
    the backward's weight gradients are allocated while the reduce-scatter still runs on the side
    stream) and the reduce-scatter; twice in a row, so the second round runs in the other buffer
    half. Returns (whether the group has symmetric memory, the copy engines' largest relative
    error, NCCL's): fp32 rounding alone reaches a few 1e-5 here (the activations grow through
    the two rounds), so the copy engines are held to NCCL's own error, not to a fixed bound."""
    import torch.distributed as dist

    from fxmegatron.ops import copy_engine
    from fxmegatron.ops.overlapped_linear import gathered_linears, scattered_linear

    pg = dist.group.WORLD
    name = pg.group_name
    B, S, H = 3, 8 * world, 32
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(B, S // world, H, generator=g).cuda()
    ws0 = [torch.randn(H // world, H, generator=g).cuda() for _ in range(3)]
    bs0 = [torch.randn(H // world, generator=g).cuda() for _ in range(3)]
    w20 = torch.randn(H, H // world, generator=g).cuda()
    usable = copy_engine.usable(x0, pg, name)

    def run(transport, dtype=torch.float32):
        x = x0.to(dtype, copy=True).requires_grad_()
        ws = [w.to(dtype, copy=True).requires_grad_() for w in ws0]
        bs = [b.to(dtype, copy=True).requires_grad_() for b in bs0]
        w2 = w20.to(dtype, copy=True).requires_grad_()
        y = None
        for _ in range(2):
            q, k, v = gathered_linears(x if y is None else y, ws, bs, 1, world, name, 4, transport)
            y = scattered_linear(torch.tanh(q) * k + v, w2, 1, world, name, 4, transport)
        y.pow(2).sum().backward()
        return [y.detach(), x.grad, w2.grad] + [t.grad for t in ws + bs]

    def err(got, ref):
        return max(((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, ref))

    ref = run("nccl", torch.float64)
    nccl = run("nccl")
    ce = run("copy_engine" if usable else "nccl")
    return usable, err(ce, ref), err(nccl, ref)


def grad_accum_errors(rank, world, layout, microbatches, n_layer=4, batch_size=16):
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
                                    grad_accum_dtype=accum)
        pm.train_step(b)
        full = pm.full_grads()
        num = sum(((full[n].double() - p.grad) ** 2).sum().item() for n, p in ref.named_parameters() if n in full)
        den = sum((p.grad ** 2).sum().item() for n, p in ref.named_parameters() if n in full)
        missing = [n for n, p in pm.named_parameters() if p.grad is None]
        out[str(accum)] = {"err": (num / den) ** 0.5, "n": len(full), "missing": missing}
    return out


def copy_engine_agreement(rank, world, fail_allocate, fail_rendezvous):
    """``copy_engine.agree_to_set_up`` with the allocation failing on rank ``fail_allocate`` or
    the rendezvous on rank ``fail_rendezvous`` (-1: none): (result, rendezvous was called)."""
    import torch.distributed as dist

    from fxmegatron.ops.copy_engine import agree_to_set_up
    called = []

    def allocate():
        if rank == fail_allocate:
            raise RuntimeError("no symmetric memory here")
        return torch.zeros(4)

    def rendezvous(buf):
        called.append(True)
        if rank == fail_rendezvous:
            raise RuntimeError("rendezvous failed")
    return agree_to_set_up(dist.group.WORLD, torch.device("cpu"), allocate, rendezvous), bool(called)
