"""The training loop of ``fxmegatron train``, on every rank: parallelize the prepared model, resume,
then per step: learning rate, train_step, gradient norm, non-finite check, clipped optimizer step,
evaluation and checkpoints on their cadence, logging on rank 0. Each step's batch and rate depend
only on the step, so a run resumed at any layout sees what an uninterrupted one would."""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

import fxmegatron
from fxmegatron.errors import TrainingError
from fxmegatron.layout import default_schedule
from fxmegatron.optim import FusedAdamW, clip_coefficient
from fxmegatron.optim.sharded_adamw import ShardedAdamW
from fxmegatron.runtime.distributed import Env, make_mesh
from fxmegatron.runtime.grad_norm import scale_grads_
from fxmegatron.train import checkpoints
from fxmegatron.train.config import TEXT_KINDS
from fxmegatron.train.lr import lr_at
from fxmegatron.train.metrics import Metrics, Progress, flops_per_token, peak_memory_gib
from fxmegatron.train import moe_load
from fxmegatron.train.setup import Prepared
from fxmegatron.train.watchdog import Watchdog, check_finite
from fxmegatron.train.wandb_sink import WandbSink

H100_BF16_TFLOPS = 989.0


def layout_line(cfg) -> str:
    lay = cfg.layout
    s = f"dp={lay.dp} pp={lay.pp} tp={lay.tp}"
    if lay.cp > 1:
        s = f"dp={lay.dp} pp={lay.pp} cp={lay.cp} tp={lay.tp} ({lay.cp_attention})"
    if lay.ep > 1:
        s += f" ep={lay.ep}"
    if lay.pp > 1:
        sched = lay.schedule or default_schedule(lay.virtual_stages)
        s += f" ({sched}, v={lay.virtual_stages})"
    s += f", m={lay.microbatches}"
    overlap = lay.tp_comm_overlap or lay.overlap
    compiled = "compile" if lay.compile is True else f"compile={lay.compile}"
    for flag, text in ((lay.sequence_parallel, "SP"), (lay.recompute != "none", f"recompute={lay.recompute}"),
                       (lay.fuse, "fuse"), (lay.compile, compiled), (overlap, f"overlap={overlap}")):
        if flag:
            s += f", {text}"
    return s


def build_optimizer(pm, cfg):
    """AdamW with weight decay on matrices only: biases, norms and other parameters of fewer than
    2 dims go to a second group without decay (Megatron's rule)."""
    o = cfg.optim
    named = list(pm.named_parameters())
    # the unmodified model's dims: under dp_shard="full" every parameter here is a flat shard
    decay = [p for n, p in named if pm.param_dims(n) >= 2]
    rest = [p for n, p in named if pm.param_dims(n) < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if pm.dp_shard != "none":       # this rank's share of FusedAdamW's state (checked at load: optim.fused)
        return pm.adamw(groups, **kw)
    return FusedAdamW(groups, **kw) if o.fused else torch.optim.AdamW(groups, **kw)


def _say(lead: bool, progress: Optional[Progress], text: str) -> None:
    if lead:
        (progress.message if progress is not None else print)(text)


def _evaluate(pm, prep: Prepared, device) -> float:
    losses = [pm.eval_step(prep.batch(w, device)).item() for w in prep.valid]
    return sum(losses) / len(losses)


def _nonfinite_rank(loss: float, norm: float, device) -> Optional[int]:
    """The lowest rank whose loss or gradient norm is not finite (None: none), the same on every
    rank. A NaN in one rank's copy of a weight replicated over tp (whose square only tp rank 0
    adds to the norm), or on one dp replica, reaches no other rank's norm: ranks deciding alone
    would update apart, or stop a step apart."""
    if not dist.is_initialized():
        return None if math.isfinite(loss) and math.isfinite(norm) else 0
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if not (math.isfinite(loss) and math.isfinite(norm)) else world],
                         dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    r = int(first.item())
    return None if r == world else r


def train(prep: Prepared, env: Env, t_start: float) -> int:
    cfg, lay, lead = prep.cfg, prep.cfg.layout, env.lead
    device = env.device
    # a "cp" dim only when there is context parallelism: cp = 1 builds the mesh it always did
    mesh = make_mesh(env, dp=lay.dp, pp=lay.pp, cp=lay.cp if lay.cp > 1 else None, tp=lay.tp)
    src = prep.source
    example = prep.batch(prep.train.windows(0), device)
    first = cfg.run.first_step_s
    with Watchdog(env.rank, env.world, cfg.run.watchdog_s, first_step_timeout_s=first) as wd:
        wd.step(-1, timeout_s=first)     # parallelize, as a step of its own with the first step's allowance
        t0 = time.perf_counter()
        layout = dataclasses.replace(prep.layout, state_dict=src.state_dict)
        pm = fxmegatron.parallelize(src.model, mesh, example, **layout.options())
        t_parallelize = time.perf_counter() - t0
        if cfg.log.dump:
            pm.dump(cfg.log.dump)
            if lead:
                print(f"fxmegatron train: the graph dump of every rank is in {cfg.log.dump}/rank*", flush=True)
        opt = build_optimizer(pm, cfg)
        start = 0
        resume = checkpoints.resume_from(cfg.checkpoint.dir, cfg.checkpoint.resume)
        if resume is not None:
            extra = fxmegatron.io.checkpoint.load(pm, opt, resume)
            prep.train.check_state(extra.get("data", {}), cache_dir=os.path.join(cfg.run.out, "cache"))
            start = int(extra["step"])
        if start >= cfg.run.steps:
            if lead:
                print(f"fxmegatron train: {resume} is at step {start}, and run.steps is {cfg.run.steps}: nothing to "
                      f"do (raise run.steps to train on, or set checkpoint.resume = \"none\" to start afresh)")
            return 0
        return _loop(pm, opt, prep, env, wd, start, resume, t_parallelize, t_start)


def _loop(pm, opt, prep: Prepared, env: Env, wd, start: int, resume: Optional[str], t_parallelize: float,
          t_start: float) -> int:
    cfg, lead, device = prep.cfg, env.lead, env.device
    o, steps = cfg.optim, cfg.run.steps
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    flops_step = flops_per_token(prep.source.model, cfg.data.seq_len, prep.layers, prep.hidden) * tokens_per_step
    peak = cfg.run.peak_tflops or (H100_BF16_TFLOPS if device.type == "cuda" else 0.0)
    # the data's fingerprint hashes every token once; its digest is cached beside the token cache
    extra = {"model": prep.source.describe, "data": prep.train.state(os.path.join(cfg.run.out, "cache")),
             "config": cfg.as_dict(),
             "layout": {"dp": cfg.layout.dp, "pp": cfg.layout.pp, "cp": cfg.layout.cp, "tp": cfg.layout.tp}}
    files = {}
    if cfg.data.kind in TEXT_KINDS and cfg.data.tokenizer != "bytes":     # a chat template with it
        files["tokenizer"] = cfg.data.tokenizer
    sink = WandbSink(cfg.run.out, cfg.log.wandb_project, cfg.log.wandb_mode, cfg.as_dict(), start, cfg.source) \
        if lead and cfg.log.wandb else None
    metrics = Metrics(cfg.run.out, start, cfg.log.tensorboard, cfg.log.jsonl, sink) if lead else None
    progress = Progress(steps, cfg.run.log_every, start) if lead else None
    if lead:
        n_local = sum(p.numel() for p in pm.parameters())
        print(f"fxmegatron train: {env.world} process(es) ({env.backend}, {device.type}), {layout_line(cfg)}")
        print(f"  model: {prep.name}, {prep.n_params:,} parameters ({n_local:,} on rank 0), "
              f"{cfg.run.precision}; {flops_step / tokens_per_step / 1e6:.1f} MFLOP per token")
        print(f"  data: {prep.tokens_train:,} training tokens, {prep.tokens_valid:,} held out; global batch "
              f"{cfg.data.global_batch} x {cfg.data.seq_len}; {steps} steps; parallelize {t_parallelize:.1f} s")
        if resume:
            print(f"  resumed from {resume} at step {start}")
            if cfg.model.init_from:     # train.init_from: the run's own checkpoint wins
                print(f"  model.init_from {cfg.model.init_from} not read: this run has a checkpoint to resume from")
        elif cfg.model.init_from:
            print(f"  weights from {cfg.model.init_from} (model.init_from): step 0, a fresh optimizer")
    stop = checkpoints.StopRequest(device)
    saved_at = start if resume else -1
    last_val: Optional[float] = None
    t_train = time.perf_counter()
    step = start
    # layout.ep > 1: the load-imbalance figure per step (not under CUDA-graph replays)
    experts = moe_load.expert_parallel(pm, cfg.layout.compile)
    try:
        for step in range(start, steps):
            # the first step of a run (or of a resumed one) compiles: it gets the longer allowance
            wd.step(step, timeout_s=cfg.run.first_step_s if step == start else None)
            t0 = time.perf_counter()
            lr = lr_at(step, steps, o.lr, o.min_lr, o.warmup_steps, o.decay, o.wsd_fraction)
            for g in opt.param_groups:
                g["lr"] = lr
            if experts:
                moe_load.discard()      # what evaluation's forwards recorded
            loss_t = pm.train_step(prep.batch(prep.train.windows(step), device))
            norm_t = pm.grad_norm()
            loss, norm = loss_t.item(), norm_t.item()
            bad = _nonfinite_rank(loss, norm, device)
            if bad is None:
                coef = clip_coefficient(norm_t, o.grad_clip) if o.grad_clip > 0 else None
                if isinstance(opt, (FusedAdamW, ShardedAdamW)):
                    opt.step(coef)
                else:
                    if coef is not None:
                        scale_grads_(pm.parameters(), coef)
                    opt.step()
            elif cfg.run.on_nonfinite == "stop":
                check_finite(step, loss, norm, "stop")      # on the rank that holds them: names the values
                raise TrainingError(f"step {step}: rank {bad}'s loss or gradient norm is not finite (non-finite "
                                    f"policy 'stop')")
            else:
                _say(lead, progress, f"step {step}: loss {loss}, gradient norm {norm} (rank {bad}: not finite): "
                                     f"update skipped")
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens_per_step / dt,
                   "tflops_per_device": flops_step / dt / env.world / 1e12,
                   "mfu": (flops_step / dt / env.world / 1e12 / peak) if peak else float("nan"),
                   "mem_gib": peak_memory_gib(device), "elapsed_s": time.perf_counter() - t_train,
                   "val_loss": None, "moe_imbalance": moe_load.moe_imbalance(pm, device) if experts else None}
            done = step + 1
            wd.step(step, timeout_s=cfg.run.first_step_s)      # evaluation and a save may follow
            if done == steps or (cfg.eval.every and done % cfg.eval.every == 0):
                row["val_loss"] = last_val = _evaluate(pm, prep, device)
                _say(lead, progress, f"step {done}: train loss {loss:.4f}, validation loss {last_val:.4f}")
            if lead:
                metrics.log(row)
                progress.update(row)
            stopping = stop.agreed()
            saving = done == steps or stopping or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
            if saving or (cfg.run.check_replicas_every and done % cfg.run.check_replicas_every == 0):
                pm.check_replicas(after=f"after step {done}")      # no checkpoint of copies that parted
            if saving:
                path = checkpoints.save(pm, opt, cfg.checkpoint.dir, done, cfg.checkpoint.keep, extra, files)
                saved_at = done
                _say(lead, progress, f"step {done}: checkpoint {path}")
            if stopping:
                _say(lead, progress, f"stopped by SIGTERM after step {done}; checkpoint saved at step {saved_at}")
                return 0
    finally:
        stop.restore()
        if lead:
            progress.close()
            metrics.close()
    if lead:
        _summary(prep, metrics, last_val, t_start, t_train)
    return 0


def _summary(prep: Prepared, metrics: Metrics, last_val: Optional[float], t_start: float, t_train: float) -> None:
    cfg = prep.cfg
    rows = metrics.rows
    if cfg.log.plot and rows:
        path = os.path.join(cfg.run.out, "loss.png")
        metrics.plot(path, f"{prep.name} ({prep.n_params / 1e6:.2f}M parameters)\n"
                           f"{layout_line(cfg)}")
    k = max(1, len(rows) // 10)
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    tps = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]
    print(f"loss        {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} (mean of first {k} steps {first:.4f}, "
          f"last {k} steps {last:.4f})" + (f"; validation {last_val:.4f}" if last_val is not None else ""))
    print(f"throughput  {len(tps) / sum(1 / t for t in tps):,.0f} tokens/s (steps after the first)")
    print(f"wall time   {time.perf_counter() - t_start:.1f} s (training {time.perf_counter() - t_train:.1f} s)")
    print(f"files       {metrics.path}" + (f", {metrics.jsonl}" if metrics.jsonl else "")
          + (f", {os.path.join(cfg.run.out, 'loss.png')}" if cfg.log.plot else "")
          + (f", {os.path.join(cfg.run.out, 'tensorboard')}" if cfg.log.tensorboard else ""))

