"""Worker of tests/test_expert_load.py: what the expert-parallel rewrite records per block in a
training step, next to the routers of the unmodified model."""
import copy

import torch


def ep_counts(rank, world, dims, kw):
    """Mixtral (tests/families.py, 2 layers, 4 experts, top-2) at mesh ``dims`` and parallelize's
    keywords ``kw``: the rows per expert of each layer of the unmodified model on the global batch
    (top-2 of its router logits), what this rank recorded in one training step
    (``take_expert_counts``), a second take (empty), this rank's ep and pp coordinates, and the
    trainer's ``moe_imbalance`` of a second step."""
    import fxmegatron
    from fxmegatron.ops.expert_load import take_expert_counts
    from fxmegatron.train.moe_load import moe_imbalance
    from tests.workers.sharded_dp import _mesh, _model_and_batches

    model, batch = _model_and_batches("mixtral")
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(copy.deepcopy(model), _mesh(dims), batch(0), **kw)
    take_expert_counts()         # nothing before the first step
    out = {"ref": [], "ref2": []}
    for step, key in ((1, "ref"), (2, "ref2")):
        b = batch(step)
        with torch.no_grad():
            logits = ref(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"),
                         output_router_logits=True).router_logits
        for lg in logits:
            out[key].append(torch.bincount(torch.topk(lg, 2, dim=-1).indices.flatten(), minlength=4).tolist())
        if step == 1:
            pm.train_step(b)
            out["recorded"] = {n: t.tolist() for n, t in take_expert_counts().items()}
            out["again"] = take_expert_counts()
        else:
            pm.train_step(b)
            out["figure"] = moe_imbalance(pm, torch.device("cpu"))
    ax = pm.program.axes
    out["ep"] = (ax["ep"].rank, ax["ep"].size)
    out["pp"] = ax["pp"].rank if "pp" in ax else 0
    return out


def ep_counts_of(rank, world, names):
    """Per model of ``names`` (tests/workers/sharded_dp.py's: "gpt_oss@batched_mm" the gathered
    dispatch, "llama4_text" the dense one) at dp2 × ep2: what this rank recorded in one training
    step ({block: rows per local expert}), the global batch's tokens and the model's top-k."""
    import fxmegatron
    from fxmegatron.ops.expert_load import take_expert_counts
    from tests.workers.sharded_dp import _mesh, _model_and_batches

    out = {}
    for name in names:
        model, batch = _model_and_batches(name)
        pm = fxmegatron.parallelize(copy.deepcopy(model), _mesh({"dp": world}), batch(0), ep=2)
        take_expert_counts()
        b = batch(1)
        pm.train_step(b)
        cfg = getattr(model.config, "text_config", model.config)
        out[name] = {"recorded": {n: t.tolist() for n, t in take_expert_counts().items()},
                     "tokens": b["input_ids"].numel(), "k": cfg.num_experts_per_tok}
    return out
