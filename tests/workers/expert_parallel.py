"""Workers of tests/test_expert_parallel.py: MoE models at ep > 1 against the unmodified model,
step by step, on gloo."""
import copy
import math

import torch

from tests import models
from tests.workers.sharded_dp import _mesh, _model_and_batches, step_batch


class _Eager:
    """The unmodified model, as ep_parity's reference: a step's loss, its gradients, a forward."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def step(self, b):
        loss = models.call(self.model, b)
        loss.backward()
        return loss.item()

    def grads(self):
        return {n: w.grad for n, w in self.model.named_parameters() if w.grad is not None}

    def zero_grad(self):
        self.model.zero_grad()

    def forward(self, b):
        with torch.no_grad():
            out = self.model(**b) if isinstance(b, dict) else None
        return out.loss.item(), out.logits


class _Parallel(_Eager):
    """A parallelized model as the reference (another layout of the same semantics)."""

    def step(self, b):
        return self.model.train_step(b).item()

    def grads(self):
        return self.model.full_grads()

    def forward(self, b):
        return self.model.eval_step(b).item(), self.model.logits(b)


def ep_parity(rank, world, dims, names, kw, steps=3, ref_kw=None):
    """``steps`` SGD steps on different batches with masked labels at mesh ``dims`` and
    ``parallelize``'s keywords ``kw`` (``ep`` among them), next to the same on the unmodified
    model (``ref_kw``: on the model parallelized with these keywords instead): per model and step
    the two losses and, per parameter, the largest difference of the whole gradients over the
    reference's largest magnitude; and the local shapes of the expert weights."""
    import fxmegatron

    mesh = _mesh(dims)
    out = {}
    for name in names:
        model, batch = _model_and_batches(name)
        ref = _Eager(copy.deepcopy(model)) if ref_kw is None else \
            _Parallel(fxmegatron.parallelize(copy.deepcopy(model), mesh, batch(0), **ref_kw))
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, batch(0), **kw)
        # SGD: AdamW's step is about lr whatever the gradient's size, so the rounding of a near-zero
        # gradient moves a weight by lr (dp alone shows 1e-4 after one step of it); SGD's moves it by
        # the rounding, and each step's gradients are compared at (nearly) the same weights
        opt = torch.optim.SGD(pm.parameters(), lr=0.5)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
        losses, losses_ref, errs = [], [], []
        for step in range(steps):
            b = step_batch(batch, step)
            losses_ref.append(ref.step(b))
            losses.append(pm.train_step(b).item())
            grads, grads_ref = pm.full_grads(), ref.grads()
            err = {}
            for n, g in grads_ref.items():
                if n in grads:
                    err[n] = ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
            errs.append(err)
            opt_ref.step()
            ref.zero_grad()
            opt.step()
            pm.zero_grad()
        # forward only, after the steps (dropout-free models): eval_step's loss, and the logits where
        # there is no pipeline (each rank runs the same pieces of the batch: collective over ep) and
        # no cp (a cp rank's logits are its chunks of the sequence)
        b = batch(30)
        loss_ref, logits_ref = ref.forward(b)
        evals = (pm.eval_step(b).item(), loss_ref)
        logits_err = None
        if pm.program.pipeline is None and "cp" not in dims:
            logits_err = ((pm.logits(b) - logits_ref).abs().max() / logits_ref.abs().max()).item()
        out[name] = {"losses": losses, "losses_ref": losses_ref, "errs": errs, "eval": evals, "logits_err": logits_err,
                     # an expert's local shape (under dp_shard="full" the piece its shard is cut from), and
                     # how many elements each parameter holds here
                     "experts": {n: tuple(pm.program.dp_shards.get(n, p.shape)) for n, p in pm.named_parameters()
                                 if n in pm.program.experts},
                     "held": {n: (p.numel(), math.prod(pm.program.dp_shards.get(n, p.shape)))
                              for n, p in pm.named_parameters()},
                     "whole": {n: tuple(p.shape) for n, p in model.named_parameters() if n in pm.program.experts}}
    return out


def ep_checkpoint(rank, world, directory, shard="none", dims=None):
    """Mixtral at dp2: one AdamW step at ep2, saved; loaded at ep1 (its whole experts put together
    from both ranks' files) and saved again; loaded at ep2 again. Each load: the full state
    dict and the optimizer's whole state as saved (bitwise), and the next two steps' losses as
    the saving run's (1e-6; the second follows an update that reads the moments). ``shard``: the
    ep2 runs' ``dp_shard`` (a sharded optimizer keeps pieces, not a state per parameter: its
    moments are compared through the second loss alone). ``dims``: the mesh (default: dp over every
    rank)."""
    import fxmegatron
    from fxmegatron.io import checkpoint
    from fxmegatron.runtime.gather import gather_layout

    mesh = _mesh(dims or {"dp": world})
    model, batch = _model_and_batches("mixtral")

    def build(ep):
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, batch(0), ep=ep, dp_shard=shard if ep > 1 else "none")
        return pm, pm.adamw(lr=1e-2)

    def state(pm, opt):
        full = pm.full_state_dict()
        names = {id(p): n for n, p in pm.named_parameters()}
        # under dp_shard="full" a moment is a flat shard, as its parameter: whole_local puts it together
        moments = {names[id(p)]: gather_layout(pm.whole_local(names[id(p)], st["exp_avg"]),
                                               pm.program.param_layout(names[id(p)]), pm.program.axes)
                   for p, st in getattr(opt, "state", {}).items()}
        return full, moments

    def next_losses(pm, opt):
        losses = []
        for seed in (21, 22):
            losses.append(pm.train_step(batch(seed)).item())
            opt.step()
            pm.zero_grad()
        return losses

    out = {}
    pm, opt = build(2)
    pm.train_step(batch(20))
    opt.step()
    pm.zero_grad()
    checkpoint.save(pm, opt, f"{directory}/a")
    saved = state(pm, opt)
    out["loss_a"] = next_losses(pm, opt)
    for tag, ep, src in (("b", 1, "a"), ("c", 2, "b")):
        pm, opt = build(ep)
        checkpoint.load(pm, opt, f"{directory}/{src}")
        got = state(pm, opt)
        out[f"same_{tag}"] = [n for n in saved[0] if not torch.equal(saved[0][n], got[0][n])] + \
            [n for n in saved[1] if n in got[1] and not torch.equal(saved[1][n], got[1][n])]
        if tag == "b":
            checkpoint.save(pm, opt, f"{directory}/b")
        out[f"loss_{tag}"] = next_losses(pm, opt)
    return out


def ep_router_loss_refused(rank, world):
    """parallelize at ep2 (dp2) with two microbatches of an MoE whose loss adds its router's
    load-balancing term: the message of the refusal, or None."""
    import fxmegatron
    from fxmegatron.errors import LossError
    from tests.workers.loss_split import moe_batch, qwen3_moe
    try:
        fxmegatron.parallelize(qwen3_moe(True), _mesh({"dp": world}), moe_batch(0), ep=2, microbatches=2)
    except LossError as exc:
        return str(exc)
    return None
