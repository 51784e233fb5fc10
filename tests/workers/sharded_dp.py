"""Sharded data parallelism (``dp_shard="optimizer"`` unless ``kw`` says another): AdamW steps with clipping next to the
unmodified model's, and what each rank holds."""
import copy
import math
import weakref

import torch

from fxmegatron.runtime.sharded_dp import in_buffer, padded_numel
from tests import models


def _mesh(dims):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))


def _model_and_batches(name):
    """(model, batch(seed)): the test models, an MoE of tests/workers/loss_split.py, or a family of
    tests/families.py (HF, 2 layers)."""
    if name in ("gpt", "gpt2", "llama"):
        return models.build(name, n_layer=4), lambda seed: models.batch(name, seed=seed, batch_size=8)
    from tests.workers.loss_split import MOE, moe_batch
    name, _, experts = name.partition("@")      # "gpt_oss@batched_mm": transformers' experts implementation
    name, _, aux = name.partition("+")          # "+aux": its router's load-balancing loss on (passes.batch_term)
    if aux:
        model, batch = _model_and_batches(name)
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.1
        model.router_aux_loss_coef = 0.1     # read from the config at construction
        if aux == "auxmask":     # and an attention mask: the masked form of the loss (ratios of sums)
            return model, lambda seed: {**batch(seed), "attention_mask": _mask(batch(seed))}
        return model, batch
    if name in MOE:     # without its router loss: dp splits the batch
        model = MOE[name](False)
        if experts:
            model.set_experts_implementation(experts)
        return model, lambda seed: moe_batch(seed, rows=8)
    if name == "llama4_text":
        from tests.test_expert_recognise import _moe_tp
        return _moe_tp("llama4_text")[0], lambda seed: moe_batch(seed, rows=8)
    if name == "deepseek_v3":
        from tests.test_expert_recognise import _deepseek_v3
        return _deepseek_v3()[0], lambda seed: moe_batch(seed, rows=8)
    from tests.families import FAMILIES, make_batch
    fam = FAMILIES[name]
    torch.manual_seed(1234)
    return fam.build(), lambda seed: make_batch(fam, seed, batch_size=8)


def _mask(b):
    """An attention mask that hides the last two tokens of every other row."""
    m = torch.ones_like(b["input_ids"])
    m[::2, -2:] = 0
    return m


def step_batch(batch, step):
    """Step ``step``'s batch: a fresh one (seed 10 + step) with a run of one row's labels masked."""
    b = batch(10 + step)
    labels = b[1] if isinstance(b, tuple) else b["labels"]
    labels[step % 8, : 3 + step] = -100
    return b


def _groups(named, dims=lambda n, p: p.dim()):
    """Megatron's rule, as the trainer's: no weight decay on parameters of fewer than 2 dims
    (``dims(name, param)``: in the unmodified model)."""
    named = list(named)
    return [{"params": [p for n, p in named if dims(n, p) >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if dims(n, p) < 2], "weight_decay": 0.0}]


def shard_parity(rank, world, dims, names, steps=5, max_norm=0.05, kw=None, small=False, moved=False):
    """``steps`` clipped AdamW steps on different batches with masked labels at mesh ``dims``
    ({"dp": 2, "tp": 2, ...}) with the optimizer sharded, next to ``torch.optim.AdamW`` and
    ``clip_grad_norm_`` on the unmodified model: per model, the losses, norms, each parameter's
    relative error after the last step, and the bytes of optimizer state on this rank. ``small``:
    buckets of 20 kB and optimizer chunks of 50 kB (many of each, parameters cut across ranks).
    ``moved``: the first bucket's first parameter given new storage after ``parallelize`` (so it no
    longer lies in its bucket's buffer: that bucket is gathered through copies)."""
    import fxmegatron
    from fxmegatron.optim import clip_coefficient

    mesh = _mesh(dims)
    out = {}
    for name in names:
        model, batch = _model_and_batches(name)
        ref = copy.deepcopy(model)
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, batch(0), **{"dp_shard": "optimizer", **(kw or {})})
        chunk = {}
        if small:
            from fxmegatron.runtime.data_parallel import GradSync
            old = pm._grad_sync
            old.remove()
            pm._grad_sync = GradSync(old.params, old.uses, old.group, old.world, bucket_mb=0.02, divisor=old.divisor,
                                     shard=True, rank=old.rank, alone=old.alone, every_microbatch=old.every_microbatch,
                                     sum_dtype=old.sum_dtype)
            chunk = {"chunk_mb": 0.05}
        if moved:
            p = pm._grad_sync.buckets[0][0]
            p.data = p.data.clone()
        held = _watch_gradients(pm) if pm.program.pipeline is None and pm.grad_sync is not None else None
        opt = pm.adamw(_groups(pm.named_parameters(), lambda n, p: pm.param_dims(n)), lr=1e-3, **chunk)
        opt_ref = torch.optim.AdamW(_groups(ref.named_parameters()), lr=1e-3)
        losses, losses_ref, norms, norms_ref = [], [], [], []
        grad_max = {n: torch.zeros_like(w) for n, w in ref.named_parameters()}
        for step in range(steps):
            b = step_batch(batch, step)
            loss_ref = models.call(ref, b)
            loss_ref.backward()
            for n, w in ref.named_parameters():
                grad_max[n] = torch.maximum(grad_max[n], w.grad.abs())
            norms_ref.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
            opt_ref.step()
            opt_ref.zero_grad()
            losses_ref.append(loss_ref.item())
            losses.append(pm.train_step(b).item())
            norm = pm.grad_norm()
            norms.append(norm.item())
            opt.step(clip_coefficient(norm, max_norm))
        full = pm.full_state_dict()
        want = dict(ref.named_parameters())
        # elements whose gradient is zero in exact arithmetic (a key bias: softmax ignores a shift
        # per query) get rounding noise, which AdamW turns into steps of about lr: left out
        top = max(g.max().item() for g in grad_max.values())
        err = {}
        for n, w in want.items():
            live = grad_max[n] > 1e-6 * top
            err[n] = ((full[n] - w).abs()[live].max() / w.abs().max().clamp_min(1e-30)).item() if live.any() else 0.0
        numel = sum(p.numel() for p in pm.parameters())
        whole = sum(math.prod(pm.program.dp_shards.get(n, p.shape)) for n, p in pm.named_parameters())
        out[name] = {"losses": losses, "losses_ref": losses_ref, "norms": norms, "norms_ref": norms_ref, "err": err,
                     "state_bytes": opt.state_bytes(), "param_numel": numel,
                     "expert_numel": sum(p.numel() for n, p in pm.named_parameters() if n in pm.program.experts),
                     "expert_whole": sum(math.prod(pm.program.dp_shards.get(n, p.shape))
                                         for n, p in pm.named_parameters() if n in pm.program.experts),
                     "noise": sum(int((g <= 1e-6 * top).sum()) for g in grad_max.values()),
                     "whole_numel": whole, "n_params": len(list(pm.parameters())), "buckets": len(pm._grad_sync.buckets) if pm._grad_sync else 0,
                     "chunks": len(getattr(opt, "chunks", ())),
                     # per bucket: its parameters still lie in its buffer (gathered in place)
                     "in_place": [in_buffer(b, f, s.world) for s in pm.grad_syncs if s.world > 1
                                  for b, f in zip(s.buckets, s.param_buffers)]}
        if held is not None:
            sync = pm._grad_sync
            out[name].update(held, sums_expected=sum(padded_numel(b, world) // world * b[0].element_size()
                                                     for b in sync.buckets))
    return out


def _watch_gradients(pm):
    """At the start of every forward of a microbatch but a step's first: the bytes of whole
    gradients in ``.grad`` (the most seen), the launches in flight and the bytes of reduced
    pieces summed so far (``dp_shard="gradients"``)."""
    seen = {"whole_grad_bytes": 0, "in_flight": 0, "sums_bytes": 0, "boundaries": 0}
    sync = pm._grad_sync

    def look(*_):
        if not sync.active or not any(sync._count.values()):       # a step's first microbatch
            return
        seen["boundaries"] += 1
        seen["whole_grad_bytes"] = max(seen["whole_grad_bytes"], sum(p.grad.numel() * p.grad.element_size()
                                                                     for p in pm.parameters() if p.grad is not None))
        seen["in_flight"] = max(seen["in_flight"], len(sync._in_flight))
        seen["sums_bytes"] = max(seen["sums_bytes"], sum(t.numel() * t.element_size() for t in sync._sums
                                                         if t is not None))
    pm.graph_module.register_forward_pre_hook(look)
    return seen


def wrong_optimizer(rank, world):
    """dp_shard with an optimizer over pm.parameters(): the second train_step's error."""
    import fxmegatron
    from fxmegatron.errors import ShardingError

    model = models.build("gpt", n_layer=1)
    pm = fxmegatron.parallelize(model, _mesh({"dp": world}), models.batch("gpt", batch_size=4), dp_shard="optimizer")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm.train_step(models.batch("gpt", seed=1, batch_size=4))
    no_grads = all(p.grad is None for p in pm.parameters())
    opt.step()
    try:
        pm.train_step(models.batch("gpt", seed=2, batch_size=4))
    except ShardingError as e:
        return no_grads, str(e)
    return no_grads, None


def gather_counts(rank, world, kw):
    """``dp_shard="full"``, the bundled GPT (2 blocks), dp ``world``: the unshard nodes of the
    rank's graph (its recomputed regions' included) and the all-gathers one step makes, in the
    forward alone (``eval_step``) and in a whole ``train_step``."""
    import fxmegatron
    from fxmegatron.ops import dp_gather
    from fxmegatron.ops.dp_gather import unshard
    from fxmegatron.ops.groups import ProcessGroupComm
    from fxmegatron.passes.recompute import Recomputed

    model = models.build("gpt", n_layer=2)
    b = models.batch("gpt", batch_size=2 * world)
    pm = fxmegatron.parallelize(model, _mesh({"dp": world}), b, dp_shard="full", **kw)
    graphs = [pm.graph_module] + [m.body for m in pm.graph_module.modules() if isinstance(m, Recomputed)]
    nodes = sum(n.target is unshard for g in graphs for n in g.graph.nodes)
    groups = {".".join(n.split(".")[:2]) if n.startswith("blocks.") else n for n, _ in model.named_parameters()}
    calls = [0]
    old = ProcessGroupComm.all_gather
    # eager: the whole parameters alive (elements) right after each gather, forward or backward
    live, peak, sizes = [], [0], []
    gather = dp_gather._gather

    def counted(self, x):
        calls[0] += 1
        return old(self, x)

    def watched(shards, world, group_name, functional=False):
        out = gather(shards, world, group_name, functional)
        sizes.append(sum(t.numel() for t in out))
        live.extend(weakref.ref(t) for t in out)
        peak[0] = max(peak[0], sum(r().numel() for r in live if r() is not None))
        return out

    ProcessGroupComm.all_gather = counted
    if not kw.get("compile"):       # compiled, the gathers are inside the graph, not calls of _gather
        dp_gather._gather = watched
    # compiled, the gathers are torch's functional collectives (ops.dp_gather's functional), counted
    # as the profiler sees them run
    from torch.profiler import ProfilerActivity, profile

    def functional_gathers(prof):
        name = "_c10d_functional::all_gather_into_tensor"      # outermost: a call is several nested events
        return sum(e.name == name and (e.cpu_parent is None or e.cpu_parent.name != name) for e in prof.events())

    if kw.get("compile"):       # compiled first (tracing dispatches the ops too, on fake tensors)
        pm.eval_step(b)
        pm.train_step(b)
        calls[0] = 0
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pm.eval_step(b)
        opaque, forward = calls[0], calls[0] + functional_gathers(prof)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pm.train_step(b)
        step = calls[0] - opaque + functional_gathers(prof)
    finally:
        ProcessGroupComm.all_gather, dp_gather._gather = old, gather
    return {"nodes": nodes, "groups": len(groups), "forward": forward, "step": step, "opaque_gathers": calls[0],
            "blocks": 2, "peak_whole": peak[0] if sizes else None, "largest_group": max(sizes, default=0)}


def hybrid_refused(rank, world):
    """dp_replicate = dp without cp: the error (one rank a group to shard over)."""
    import fxmegatron
    from fxmegatron.errors import MeshError

    model = models.build("gpt", n_layer=1)
    try:
        fxmegatron.parallelize(model, _mesh({"dp": world}), models.batch("gpt", batch_size=4), dp_shard="full",
                               dp_replicate=world)
    except MeshError as e:
        return str(e)
    return None


def hybrid_groups_once(rank, world):
    """Two mesh_axes of one mesh under dp_replicate: the same groups, no new ones the second time."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from fxmegatron.mesh import mesh_axes
    mesh = _mesh({"dp": world})
    first = mesh_axes(mesh, dp_replicate=2)
    groups = len(c10d._world.pg_names)
    again = mesh_axes(mesh, dp_replicate=2)
    assert dist.is_initialized()
    return first == again, groups, len(c10d._world.pg_names), first["dp_cp"].ranks, first["dp_replicate"].ranks
