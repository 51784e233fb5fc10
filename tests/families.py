"""A matrix of tiny Hugging Face causal-LM families for correctness tests.

The bundled GPT, GPT-2 and Llama (tests/models.py) share one architecture shape: fused or
separate q/k/v, full rotary or learned positions, sequential blocks. Real checkpoints do much
more, and each oddity is a graph pattern the tensor-parallel planner has to recognise or at
least leave correct: learned positions with an offset (OPT), a scaled embedding (Gemma), a
projection between embedding and hidden size (OPT-350m), rotary on part of each head (Phi,
GPT-NeoX, StableLM, GPT-J), attention and MLP side by side (GPT-J, NeoX, Falcon, Cohere, Phi),
one kv head (Falcon, GPTBigCode), GQA, norms over q/k (per head: Qwen3, Cohere, StableLM;
over all heads: OLMo2, OLMoE), logit soft-capping (Gemma2), sliding windows, ALiBi (Bloom,
MPT), and mixtures of experts (Mixtral, Qwen2-MoE with a shared expert, OLMoE).

Every config keyword below is checked against the config class's fields (HF configs accept
unknown keywords silently, so a misspelt one would quietly test the default). Sizes are tiny
(hidden 64, intermediate 128, vocab 128) and every family is fp32, dropout-free and in train
mode, so that fxmegatron can be compared with the unmodified model to rounding error.
``use_cache`` is left at the config default on purpose: users do not turn it off, and the
cache objects HF builds during a training forward are part of what capture must survive.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch
import torch.nn as nn

VOCAB, HIDDEN, INTER, MAX_POS, SEQ = 128, 64, 128, 64, 16
PAD = 1   # inside the vocab, so that embeddings built with padding_idx get a real row

# keywords some configs take through **kwargs (legacy spellings folded into rope_parameters)
_LEGACY = {"partial_rotary_factor", "rotary_pct"}


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: str            # class names in `transformers`, imported lazily
    model_cls: str
    kwargs: Dict = field(repr=False)   # config keywords, without num layers
    layers_key: str            # the config's name for the number of layers
    features: Tuple[str, ...]
    n_head: int
    n_kv_head: int
    pad_id: int = PAD
    vocab: int = VOCAB
    seq: int = SEQ

    def config(self, n_layer: int = 2, **overrides):
        import transformers
        cls = getattr(transformers, self.config_cls)
        kw = {**self.kwargs, self.layers_key: n_layer, **overrides}
        known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        unknown = sorted(k for k in kw if k not in known and k not in _LEGACY)
        if known and unknown:
            raise TypeError(f"{self.config_cls} has no field(s) {unknown}: a typo would silently test the default")
        return cls(**kw)

    def build(self, n_layer: int = 2, seed: int = 1234, **overrides) -> nn.Module:
        """A freshly initialised model (same weights for the same seed), fp32, in train mode."""
        import transformers
        cfg = self.config(n_layer, **overrides)
        torch.manual_seed(seed)
        model = getattr(transformers, self.model_cls)(cfg).float()
        model.train()
        live = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if live and not any("drop" in k for k in overrides):
            raise AssertionError(f"{self.name}: dropout left on in {live[:3]}")
        return model


FAMILIES: Dict[str, Family] = {}


def _family(name, config_cls, model_cls, features, heads, layers_key="num_hidden_layers", seq=SEQ, **kwargs):
    """Register a family; ``heads`` is (attention heads, kv heads), ``kwargs`` the config's keywords."""
    kwargs.setdefault("vocab_size", VOCAB)
    kwargs.setdefault("pad_token_id", PAD)
    # bos/eos default to ids outside a 128-token vocab in several configs
    kwargs.setdefault("bos_token_id", 0)
    kwargs.setdefault("eos_token_id", 0)
    FAMILIES[name] = Family(name, config_cls, model_cls, kwargs, layers_key, tuple(features), *heads, seq=seq)


# Llama-style keywords shared by the RMSNorm + rotary + SwiGLU families
_LLAMA = dict(hidden_size=HIDDEN, intermediate_size=INTER, max_position_embeddings=MAX_POS,
              attention_dropout=0.0)

# ---- the baselines ---------------------------------------------------------------------------
_family("gpt2", "GPT2Config", "GPT2LMHeadModel", ["tied", "learned_pos", "conv1d"], (4, 4),
        layers_key="n_layer", n_embd=HIDDEN, n_head=4, n_inner=INTER, n_positions=MAX_POS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
_family("llama", "LlamaConfig", "LlamaForCausalLM", ["gqa", "untied"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, **_LLAMA)

# ---- positions and embeddings ----------------------------------------------------------------
# OPT: positions index a table at position + 2, and word_embed_proj_dim < hidden_size adds
# project_in / project_out linears around the decoder (opt-350m)
_family("opt", "OPTConfig", "OPTForCausalLM", ["learned_pos_offset", "embed_proj", "tied", "relu"], (4, 4),
        hidden_size=HIDDEN, ffn_dim=INTER, num_attention_heads=4, max_position_embeddings=MAX_POS,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
# Gemma: embeddings multiplied by sqrt(hidden), RMSNorm weight used as (1 + w), GeGLU; head_dim
# is a config field that defaults to 256 and must be set
_family("gemma", "GemmaConfig", "GemmaForCausalLM", ["embed_scale", "tied", "norm_plus_one"], (4, 4),
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, **_LLAMA)
# Bloom: ALiBi biases instead of positions, a LayerNorm right after the embedding, fused qkv
# laid out per head; intermediate is fixed at 4 * hidden
_family("bloom", "BloomConfig", "BloomForCausalLM", ["alibi", "tied", "embed_norm", "fused_qkv"], (4, 4),
        layers_key="n_layer", hidden_size=HIDDEN, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)
# MPT: ALiBi (in attn_config), no biases, fused Wqkv; its config defaults to use_cache=False
_family("mpt", "MptConfig", "MptForCausalLM", ["alibi", "tied", "fused_qkv", "no_bias"], (4, 4),
        layers_key="n_layers", d_model=HIDDEN, n_heads=4, expansion_ratio=INTER // HIDDEN, max_seq_len=MAX_POS,
        resid_pdrop=0.0, emb_pdrop=0.0, attn_config={"alibi": True, "attn_pdrop": 0})

# ---- partial rotary and parallel blocks ------------------------------------------------------
# Phi: half of each head rotated, attention and MLP read one LayerNorm's output, LM head has a bias
_family("phi", "PhiConfig", "PhiForCausalLM", ["partial_rotary", "parallel_block", "untied", "lm_head_bias"],
        (4, 4), num_attention_heads=4, resid_pdrop=0.0, embd_pdrop=0.0, partial_rotary_factor=0.5, **_LLAMA)
# GPT-NeoX: fused qkv interleaved per head, a quarter of each head rotated, parallel residual
_family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM",
        ["partial_rotary", "parallel_block", "untied", "fused_qkv"], (4, 4),
        hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4, max_position_embeddings=MAX_POS,
        rotary_pct=0.25, use_parallel_residual=True, attention_dropout=0.0, hidden_dropout=0.0,
        classifier_dropout=0.0)
# StableLM: partial rotary, q/k bias, and a LayerNorm per head on q and k (one weight per head)
_family("stablelm", "StableLmConfig", "StableLmForCausalLM", ["partial_rotary", "qk_norm", "qkv_bias", "untied"],
        (4, 4), num_attention_heads=4, num_key_value_heads=4, partial_rotary_factor=0.25, use_qkv_bias=True,
        qk_layernorm=True, hidden_dropout=0.0, **_LLAMA)
# GPT-J: rotary on the first rotary_dim channels with pairs interleaved (rotate_every_two),
# one LayerNorm feeding attention and MLP in parallel
_family("gptj", "GPTJConfig", "GPTJForCausalLM",
        ["partial_rotary", "parallel_block", "untied", "lm_head_bias", "rotary_interleaved"], (4, 4),
        layers_key="n_layer", n_embd=HIDDEN, n_head=4, n_inner=INTER, n_positions=MAX_POS, rotary_dim=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# Falcon-7B layout: one kv head in a fused query_key_value, parallel attention and MLP
_family("falcon", "FalconConfig", "FalconForCausalLM", ["mqa", "parallel_block", "tied", "fused_qkv"], (8, 1),
        hidden_size=HIDDEN, num_attention_heads=8, multi_query=True, parallel_attn=True,
        new_decoder_architecture=False, alibi=False, bias=False, ffn_hidden_size=INTER,
        max_position_embeddings=MAX_POS, hidden_dropout=0.0, attention_dropout=0.0)
# Falcon-RW layout: ALiBi, separate heads, sequential block, biases
_family("falcon_alibi", "FalconConfig", "FalconForCausalLM", ["alibi", "tied", "fused_qkv"], (4, 4),
        hidden_size=HIDDEN, num_attention_heads=4, multi_query=False, parallel_attn=False,
        new_decoder_architecture=False, alibi=True, bias=True, ffn_hidden_size=INTER,
        max_position_embeddings=MAX_POS, hidden_dropout=0.0, attention_dropout=0.0)
# Cohere: parallel block, per-head LayerNorm on q/k, interleaved rotary, scaled tied logits
_family("cohere", "CohereConfig", "CohereForCausalLM",
        ["parallel_block", "qk_norm", "tied", "gqa", "logit_scale", "rotary_interleaved"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, use_qk_norm=True, logit_scale=0.0625, **_LLAMA)
# GPTBigCode (StarCoder): multi-query attention in a fused c_attn
_family("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", ["mqa", "tied", "learned_pos", "fused_qkv"],
        (4, 1), layers_key="n_layer", n_embd=HIDDEN, n_head=4, n_inner=INTER, n_positions=MAX_POS,
        multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

# ---- attention variants ----------------------------------------------------------------------
# a window of 8 < SEQ = 16 tokens, so that the sliding mask differs from the causal one
_family("mistral", "MistralConfig", "MistralForCausalLM", ["gqa", "sliding_window", "untied"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, sliding_window=8, **_LLAMA)
# Qwen2: q/k/v biases; layers at index >= max_window_layers slide (layer 1 here, layer 0 is full)
_family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", ["gqa", "qkv_bias", "sliding_window", "untied"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, use_sliding_window=True, sliding_window=8,
        max_window_layers=1, **_LLAMA)
# Qwen3: RMSNorm over each head of q and k; head_dim defaults to 128 and must be set
_family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", ["gqa", "qk_norm", "untied"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, **_LLAMA)
# OLMo2: RMSNorm over all heads of q (and of k) together, norms after attention/MLP (post-norm)
_family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", ["qk_norm_full", "qk_norm", "post_norm", "untied"], (4, 4),
        num_attention_heads=4, num_key_value_heads=4, **_LLAMA)
# Gemma2: tanh soft-capping of attention scores and final logits, alternating sliding/full layers
_family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
        ["softcap", "sliding_window", "gqa", "embed_scale", "tied", "norm_plus_one", "post_norm"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, **_LLAMA)

# ---- mixtures of experts ---------------------------------------------------------------------
_MOE = dict(num_experts_per_tok=2, output_router_logits=False)
_family("mixtral", "MixtralConfig", "MixtralForCausalLM", ["moe", "gqa", "untied"], (8, 4),
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, router_jitter_noise=0.0, **_MOE,
        **_LLAMA)
_family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", ["moe", "shared_expert", "gqa", "qkv_bias", "untied"],
        (8, 4), num_attention_heads=8, num_key_value_heads=4, num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=False, **_MOE, **_LLAMA)
_family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", ["moe", "qk_norm_full", "qk_norm", "untied"], (4, 4),
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, norm_topk_prob=False, **_MOE,
        **{**_LLAMA, "intermediate_size": 32})


def make_batch(family: Family, seed: int, batch_size: int = 2, seq: int | None = None) -> dict:
    """Random ids in [2, vocab) (0 and 1 are bos/eos and pad), right-padded with the pad id on
    every odd row, and labels that ignore (-100) the padding. Padding matters: it puts the pad
    id, whose embedding row is special under padding_idx, into the batch, and makes the loss a
    mean over fewer tokens than the batch holds."""
    seq = seq or family.seq
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, family.vocab, (batch_size, seq), generator=g)
    labels = ids.clone()
    for row in range(1, batch_size, 2):
        n = int(torch.randint(1, seq // 2 + 1, (1,), generator=g))
        ids[row, seq - n:] = family.pad_id
        labels[row, seq - n:] = -100
    return {"input_ids": ids, "labels": labels}


def idiom_batch(family: Family, seed: int, batch_size: int = 2, seq: int | None = None) -> dict:
    """``model(input_ids=x, labels=x)``, the HF idiom: ONE tensor object under both keys. An
    export that dedupes aliased inputs may then trace a graph with a single placeholder,
    which is wrong for every later batch whose labels differ from its ids."""
    x = make_batch(family, seed, batch_size, seq)["input_ids"]
    return {"input_ids": x, "labels": x}
