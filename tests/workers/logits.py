"""ParallelModel.logits: the unmodified model's logits to compare with, what a logits call must
leave as it was, and the gloo worker for tensor- and pipeline-parallel layouts."""
import copy

import torch

from tests import models
from tests.workers.eval_step import same, snapshot


def reference_logits(model, name, b):
    """The unmodified model's logits in eval mode: HF's ``.logits``, the bundled GPT's LM head
    output (its forward returns only the loss)."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        if name != "gpt":
            return model(**b).logits
        got = []
        hook = model.lm_head.register_forward_hook(lambda mod, args, out: got.append(out))
        model(*b)
        hook.remove()
        return got[0]


def ids_only(name, b):
    return b[0] if name == "gpt" else {"input_ids": b["input_ids"]}


def logits_check(pm, model, name, batch_size, train=True):
    """After a train step (gradients, a dropout step) unless not ``train``: the logits of a new
    batch, whole and this rank's shard, with and without labels; the reference; what changed."""
    if train:
        pm.train_step(models.batch(name, seed=1, batch_size=batch_size))
    e = models.batch(name, seed=7, batch_size=batch_size)
    before = snapshot(pm)
    whole = pm.logits(e)
    shard = pm.logits(ids_only(name, e), gather=False)
    return {"whole": whole, "shard": shard, "ref": reference_logits(model, name, e),
            "changed": same(before, snapshot(pm)), "requires_grad": whole.requires_grad or shard.requires_grad}


def logits_layouts(rank, world, layouts, batch_size=4):
    """For each (label, mesh dims, parallelize kwargs, model names): ``logits_check`` of each
    model with dropout 0.1 (or the kwargs' ``dropout``) by (label, name), or the error a
    pipelined model raises."""
    import fxmegatron
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for label, dims, kw, names in layouts:
        mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(d for d, _ in dims))
        kw = dict(kw)
        dropout = kw.pop("dropout", 0.1)    # cp refuses attention dropout
        for name in names:
            model = models.build(name, dropout=dropout)
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=batch_size), **kw)
            if pm.pp_size > 1:
                try:
                    pm.logits(models.batch(name, batch_size=batch_size))
                    out[(label, name)] = {"error": None}
                except RuntimeError as exc:
                    out[(label, name)] = {"error": str(exc)}
                continue
            r = logits_check(pm, model, name, batch_size)
            r["tp_rank"] = pm.tp_rank
            out[(label, name)] = r
    return out
