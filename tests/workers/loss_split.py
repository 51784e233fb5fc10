"""Workers and tiny models of tests/test_loss_split.py, tests/test_id_check.py and
tests/test_random_ops.py: MoE language models with their router's load-balancing loss, a
router with jitter, and ids outside the vocabulary, on gloo."""
import copy

import torch

VOCAB = 128


def qwen3_moe(router_loss=True, **kw):
    """Qwen3-MoE-style: softmax top-k router, its load-balancing loss added to the loss."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(**{
        **dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
               output_router_logits=router_loss, router_aux_loss_coef=0.1, max_position_embeddings=64, pad_token_id=1,
               bos_token_id=0, eos_token_id=0), **kw})
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float().train()


def granite_moe(router_loss=True, **kw):
    """Granite-MoE-style: top-k then softmax, scaled logits, the same load-balancing loss."""
    import transformers
    cfg = transformers.GraniteMoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=router_loss,
        router_aux_loss_coef=0.1, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=0,
        logits_scaling=2.0, **kw)
    torch.manual_seed(0)
    return transformers.GraniteMoeForCausalLM(cfg).float().train()


def gpt_oss(router_loss=True, **kw):
    """gpt-oss-style: top-k then softmax over the chosen logits, biased experts, attention sinks;
    its load-balancing loss added the same way."""
    import transformers
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], output_router_logits=router_loss,
        router_aux_loss_coef=0.1, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=0,
        use_cache=False, **kw)
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(cfg).float().train()


def mixtral_jitter():
    """Mixtral with router jitter: in train mode the router's input is multiplied by uniform noise."""
    import transformers
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1,
        output_router_logits=False, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).float().train()


MOE = {"qwen3_moe": qwen3_moe, "granite_moe": granite_moe, "gpt_oss": gpt_oss}


def moe_batch(seed=0, rows=4, seq=8):
    """Random ids, and labels with a masked tail in one row: microbatches count different tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[1, seq // 2:] = -100
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(model, b):
    model.zero_grad()
    loss = model(**b).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def split_moe(rank, world, name):
    """dp2 × 2 microbatches and pp2 × 2 microbatches of an MoE with its router loss: refused at
    parallelize (the message); dp2 without it: the step's loss and whole gradients next to the
    plain model's. (dp2 with it and one microbatch: tests/test_batch_term.py.)"""
    import fxmegatron
    from fxmegatron.errors import LossError
    from tests.workers.common import mesh_3d
    out = {}
    for key, layout, m in (("dp2", (2, 1, 1), 2), ("pp2", (1, 2, 1), 2)):
        try:
            fxmegatron.parallelize(MOE[name](True), mesh_3d(*layout), moe_batch(0), microbatches=m)
            out[key] = None
        except LossError as exc:
            out[key] = str(exc)
    model = MOE[name](False)
    b = moe_batch(1)
    pm = fxmegatron.parallelize(copy.deepcopy(model), mesh_3d(2, 1, 1), b)
    loss = pm.train_step(b)
    grads = {n: p.grad for n, p in pm.named_parameters()}
    loss_ref, grads_ref = loss_and_grads(model, b)
    out["loss"], out["loss_ref"] = loss.item(), loss_ref.item()
    out["grad_err"] = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                          for n, g in grads_ref.items())
    return out


def gpt_batch_with_empty_microbatch(rows=4, seq=16, pieces=2):
    """The bundled GPT's (ids, targets), the last of ``pieces`` microbatches with every target -100."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    targets = torch.randint(0, VOCAB, (rows, seq), generator=g)
    targets[0, :5] = -100
    targets[rows - rows // pieces:] = -100
    return ids, targets


def empty_microbatch_pp2(rank, world):
    """pp2 × 2 microbatches (1F1B), the second with no counted label: the step's loss and this
    stage's gradients next to the plain model's on the whole batch."""
    import fxmegatron
    from tests import models
    from tests.workers.common import pp_mesh, rel_err
    model = models.build("gpt", n_layer=2)
    b = gpt_batch_with_empty_microbatch()
    pm = fxmegatron.parallelize(copy.deepcopy(model), pp_mesh(world, 2), b, microbatches=2)
    loss = pm.train_step(b)
    model.zero_grad()
    loss_ref = model(*b)
    loss_ref.backward()
    ref = dict(model.named_parameters())
    # a key bias's gradient is 0 in exact arithmetic: rounding noise is measured against 1% of the largest
    floor = 0.01 * max(p.grad.abs().max().item() for p in ref.values() if p.grad is not None)
    errs = {n: rel_err(p.grad, ref[n].grad, floor) for n, p in pm.named_parameters()}
    return loss.item(), loss_ref.item(), errs


def ids_outside_vocab_tp2(rank, world):
    """tp2 (vocab-parallel embedding and loss): an id, then a label, outside the vocabulary, in
    the bundled GPT and an HF model: the messages each rank raises (None: no error)."""
    import fxmegatron
    from fxmegatron.errors import BatchError
    from tests import models
    from tests.workers.common import tp_mesh
    out = {}
    for name in ("gpt", "llama"):
        pm = fxmegatron.parallelize(models.build(name), tp_mesh(world), models.batch(name))
        for key in ("ids", "labels"):
            b = models.batch(name, seed=1)
            flat = list(b) if isinstance(b, tuple) else [b["input_ids"], b["labels"]]
            flat[0 if key == "ids" else 1][1, 2] = VOCAB + 3
            b = tuple(flat) if isinstance(b, tuple) else {"input_ids": flat[0], "labels": flat[1]}
            try:
                out[(name, key)] = f"no error: loss {pm(b).item()}"
            except BatchError as exc:
                out[(name, key)] = str(exc)
    return out


def jitter_tp2(rank, world):
    """Mixtral with router jitter (uniform noise in train mode) at tp2: the refusal's message."""
    import fxmegatron
    from fxmegatron.errors import ShardingError
    from tests.workers.common import tp_mesh
    try:
        fxmegatron.parallelize(mixtral_jitter(), tp_mesh(world), moe_batch(0))
    except ShardingError as exc:
        return str(exc)
    return None
