"""eval_step: its loss against the unmodified model in eval mode, what it must leave as it was,
and what it keeps in memory (bytes saved for backward, live bytes of the tensors it makes)."""
import contextlib
import copy
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests import models


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made by the ops run under it and still alive: ``cur`` now, ``peak``
    the most at once. A storage is followed from the op that makes it until it is freed (a
    finalizer on its Python object, which torch keeps for as long as the storage lives);
    views and in-place results reuse an input's storage and are not counted again."""

    def __init__(self):
        super().__init__()
        self.ids, self.cur, self.peak = set(), 0, 0

    def _freed(self, key, n):
        self.ids.discard(key)
        self.cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if id(st) in self.ids or id(st) in inputs:
                continue
            n = st.nbytes()
            self.ids.add(id(st))
            self.cur += n
            self.peak = max(self.peak, self.cur)
            weakref.finalize(st, self._freed, id(st), n)
        return out


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd saves for backward, parameters left out."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.bytes = set(), 0

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in self.skip and st.data_ptr() not in self.seen:
                self.seen.add(st.data_ptr())
                self.bytes += st.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self


def masked_batch(name, seed, batch_size):
    """A batch whose labels are -100 in uneven places: microbatches and data-parallel shares
    count different numbers of tokens."""
    b = models.batch(name, seed=seed, batch_size=batch_size)
    labels = b[1] if isinstance(b, tuple) else b["labels"]
    labels[:3, 5:] = -100
    labels[batch_size - 2, :4] = -100
    return b


def rngs(pm):
    from fxmegatron.ops.dropout import DropoutRng
    return [m for m in pm.modules() if isinstance(m, DropoutRng)]


def snapshot(pm):
    return {"params": {n: p.detach().clone() for n, p in pm.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in pm.named_parameters()},
            "rng_steps": [r.step for r in rngs(pm)], "torch_rng": torch.get_rng_state(),
            "modes": [m.training for m in pm.modules()]}


def same(a, b):
    """Which parts of two snapshots differ (bitwise; a None gradient only equals None)."""
    bad = [k for k in ("rng_steps", "modes") if a[k] != b[k]]
    if not torch.equal(a["torch_rng"], b["torch_rng"]):
        bad.append("torch_rng")
    for k in ("params", "grads"):
        for n, t in a[k].items():
            u = b[k][n]
            if (t is None) != (u is None) or (t is not None and not torch.equal(t, u)):
                bad.append(f"{k}:{n}")
    return bad


def eval_check(pm, model, name, batch_size, measure=True):
    """Train step (nothing before it), eval step, None gradients through an eval step, then the
    train step again from the same state: the losses, what changed, and the memory figures."""
    b = models.batch(name, seed=1, batch_size=batch_size)
    e = masked_batch(name, seed=7, batch_size=batch_size)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        ref_loss = models.call(ref, e).item()
    params = list(pm.parameters())
    with SavedBytes(params) as saved_train:
        train = pm.train_step(b).item()
    before = snapshot(pm)
    live = LiveBytes() if measure else None
    with SavedBytes(params) as saved_eval, live or contextlib.nullcontext():
        loss = pm.eval_step(e).item()
    changed = same(before, snapshot(pm))
    for p in params:
        p.grad = None
    again = pm.eval_step(e).item()
    grads_stay_none = all(p.grad is None for p in params)
    for r in rngs(pm):          # back to the state of the first train step
        r.step = 0
    train_after = pm.train_step(b).item()
    grads_match = not [k for k in same(before, snapshot(pm)) if k.startswith("grads:")]
    return {"loss": loss, "ref": ref_loss, "again": again, "changed": changed, "grads_stay_none": grads_stay_none,
            "train": train, "train_after": train_after, "grads_match": grads_match,
            "saved_eval": saved_eval.bytes, "saved_train": saved_train.bytes,
            "peak_eval": live.peak if measure else None, "rng_steps": before["rng_steps"]}


def eval_layouts(rank, world, layouts, batch_size=4):
    """For each (label, mesh dims, parallelize kwargs, model names, n_layer): ``eval_check``
    of each model with dropout 0.1, by (label, name)."""
    import fxmegatron
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for label, dims, kw, names, n_layer in layouts:
        mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(d for d, _ in dims))
        for name in names:
            model = models.build(name, dropout=0.1, n_layer=n_layer)
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=batch_size), **kw)
            out[(label, name)] = eval_check(pm, model, name, batch_size)
            if pm.pp_size > 1 and name == "gpt":
                # a train step in eval mode: the dropout key crosses the stages in its eval form
                pm.eval()
                out[(label, name)]["train_in_eval_mode"] = pm.train_step(masked_batch(name, 7, batch_size)).item()
                pm.train()
    return out
