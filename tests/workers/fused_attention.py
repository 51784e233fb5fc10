"""fxmegatron's attention op (``fxmegatron::attention``) in the layouts that split the batch or
the model on two GPUs: pipeline stages and microbatches, data parallel, recompute regions,
compile. Each layout runs twice from the same bf16 weights, with the op and with aten's SDPA in
its place, and both are measured against the unmodified model in fp32."""
import copy

import torch

from tests.workers.common import rel_err

LAYOUTS = {   # name: (mesh (dp, pp, tp), parallelize keywords)
    "pp2-1f1b-m4": ((1, 2, 1), dict(microbatches=4)),
    "pp2-interleaved-m4": ((1, 2, 1), dict(microbatches=4, virtual_stages=2)),
    "dp2-m2": ((2, 1, 1), dict(microbatches=2)),
    "tp2-sp-recompute-selective": ((1, 1, 2), dict(sequence_parallel=True, recompute="selective")),
    "tp2-sp-recompute-full-compile": ((1, 1, 2), dict(sequence_parallel=True, recompute="full", compile=True)),
    "dp2-compile-ov": ((2, 1, 1), dict(compile=True)),
}


def _model():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batch(seed, device, batch=8, seq=128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 4] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def _attention_calls(pm):
    op = torch.ops.fxmegatron.attention.default
    return sum(1 for m in pm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function" and n.target is op)


def _run(model, mesh, kw, steps, device, with_op):
    import fxmegatron
    import fxmegatron.lower.rank_passes as rank_passes

    saved = rank_passes.fused_attention_kernel
    if not with_op:
        rank_passes.fused_attention_kernel = lambda gm: gm
    try:
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, _batch(0, device), **kw)
    finally:
        rank_passes.fused_attention_kernel = saved
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses, grads = [], None
    for i in range(steps):
        losses.append(pm.train_step(_batch(i, device)).item())
        if i == 0:
            grads = {n: g.float() for n, g in pm.full_grads().items()}
        opt.step()
        opt.zero_grad()
    return losses, grads, _attention_calls(pm)


def op_against_sdpa(rank, world, names, steps=3, device_type="cuda"):
    """Per layout: the losses of ``steps`` AdamW steps with the op and without it, the op's
    count in the program, and each local parameter's first-step gradient error against the
    fp32 unmodified model, with the op and without (``device_type`` "cpu": the same on gloo,
    where the op is never put in, to try the worker without GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device_type, rank if device_type == "cuda" else None)
    base = _model()
    ref = copy.deepcopy(base).to(device)
    ref(**_batch(0, device)).loss.backward()
    truth = {n: p.grad for n, p in ref.named_parameters()}
    scale = 0.01 * max(g.abs().max().item() for g in truth.values())
    model = base.to(device, torch.bfloat16)
    out = {}
    for name in names:
        shape, kw = LAYOUTS[name]
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "pp", "tp"))
        row = {}
        for with_op in (True, False):
            losses, grads, calls = _run(model, mesh, kw, steps, device, with_op)
            row["op" if with_op else "sdpa"] = {
                "losses": losses, "calls": calls,
                "grad_err": {n: rel_err(g, truth[n], scale) for n, g in grads.items()}}
        out[name] = row
    return out
