"""Tensor parallelism of two mixture-of-experts families whose experts and attention are
spelled otherwise than Mixtral's: gpt-oss (expert biases gathered per row by index, gate and up
features interleaved, ``gate_up[..., ::2]``, attention sinks joined to the scores by ``cat``,
the max over them) and Llama 4 (experts as ``bmm`` over a 3-D weight, rotary embeddings in
complex arithmetic through ``view_as_complex``). Before their rules they split 9% and 20% of
their matmul FLOPs at tp2; now each splits at least 90% and stays exact (fp32: loss 1e-5,
every gradient 1e-4) at tp2, and at tp2 + SP (gpt-oss) and tp4 (Llama 4)."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fxmegatron

CONFIGS = {
    "gpt_oss": dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                    layer_types=["sliding_attention", "full_attention"]),
    "llama4_text": dict(vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64,
                        attention_chunk_size=8, no_rope_layers=[1, 1], interleave_moe_layer_step=1),
}


def _model(family):
    cfg = AutoConfig.for_model(family, use_cache=False, **CONFIGS[family])
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = x.clone()
    labels[:, :3] = -100
    return AutoModelForCausalLM.from_config(cfg), {"input_ids": x, "labels": labels}


@pytest.mark.parametrize("family, layout", [
    ("gpt_oss", dict(tp=2)), ("gpt_oss", dict(tp=2, sequence_parallel=True)),
    ("llama4_text", dict(tp=2)), ("llama4_text", dict(tp=4))], ids=["gpt_oss-tp2", "gpt_oss-tp2-sp",
                                                                   "llama4-tp2", "llama4-tp4"])
def test_split_and_exact(family, layout):
    model, batch = _model(family)
    report = fxmegatron.verify(model, batch, **layout)
    assert abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref), report
    assert report.max_grad_err < 1e-4, report
    if layout["tp"] == 2:
        assert report.coverage.flops_split >= 0.9, report.coverage


@pytest.mark.parametrize("family, layout", [("olmo2", dict(tp=2, sequence_parallel=True)), ("olmoe", dict(tp=4))])
def test_a_norm_over_all_heads_keeps_attention_split(family, layout):
    """OLMo2 and OLMoE normalise q (and k) over all heads at once: each rank's mean of squares
    over its heads is a partial average, all-reduced and divided by tp where the norm reads it
    (before: attention whole, 61% and 47% of the matmul FLOPs split at tp2)."""
    from tests.families import FAMILIES, make_batch
    report = fxmegatron.verify(FAMILIES[family].build(), make_batch(FAMILIES[family], 0), **layout)
    assert abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref), report
    assert report.max_grad_err < 1e-4, report
    assert report.coverage.flops_split >= 0.99, report.coverage.summary(5)
