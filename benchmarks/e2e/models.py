"""The model a run trains, as a ``ModelSpec``: the bundled GPT (``gpt*`` presets) or an
unmodified Hugging Face causal LM (``hf-*`` presets, or any config through --hf-config). It
builds the model (real and seeded, or on the meta device for fxmegatron), the synthetic batch
and the model's own loss, and knows the shapes and the model FLOPs of a step."""
from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn as nn
from gpt import GPT, GPTConfig

GPT_MODELS = {  # layers, hidden, heads, seq, vocab, global batch
    "gpt1.3b": (24, 2048, 16, 2048, 50304, 8),
    "gpt6.7b": (32, 4096, 32, 2048, 50304, 16),
    "gpt13b": (40, 5120, 40, 2048, 50304, 32),
    # tiny: 8 layers so that fx-pp4-v2 has a block per chunk; batch 16 so that pipeline microbatches hold
    # 2 sequences: with 1, fxmegatron's gloo reduce-scatter returns a view of its input and fails
    "tiny": (8, 64, 4, 64, 512, 16),
}

# config class, its fields (the layer count apart), layers, seq, global batch
HF_MODELS = {
    # Llama-3.2-1B's shapes (its llama3 rope scaling left out: it changes no shape or cost)
    "hf-llama1b": ("LlamaConfig", dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                                       intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                                       tie_word_embeddings=True, rms_norm_eps=1e-5), 16, 2048, 4),
    # Qwen2.5-1.5B's shapes (q/k/v with bias: Qwen2's attention always has one)
    "hf-qwen1.5b": ("Qwen2Config", dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                                        intermediate_size=8960, vocab_size=151936, rope_theta=1000000.0,
                                        tie_word_embeddings=True, rms_norm_eps=1e-6), 28, 2048, 4),
    # Llama-3-8B's layer shapes, 4 of its 32 layers by default (--layers)
    "hf-llama8b": ("LlamaConfig", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                       intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                                       tie_word_embeddings=False, rms_norm_eps=1e-5), 4, 2048, 4),
    # Mixtral-8x7B's layer shapes (8 experts, top-2), 4 of its 32 layers by default
    "hf-mixtral": ("MixtralConfig", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                                         vocab_size=32000, rope_theta=1000000.0, router_jitter_noise=0.0,
                                         output_router_logits=False, tie_word_embeddings=False), 4, 2048, 4),
    # fine-grained experts (Qwen/DeepSeek-like): 64 experts of ffn 1408, top-8, Qwen3-MoE's layers
    "hf-moe64": ("Qwen3MoeConfig", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                                        head_dim=128, intermediate_size=5632, moe_intermediate_size=1408,
                                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                                        vocab_size=151936, output_router_logits=False,
                                        tie_word_embeddings=False), 8, 2048, 4),
}
# --tiny for an HF preset: the same family and tying, 4 layers (pp2-v2 gets a layer per chunk), GQA kept
HF_TINY = (dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128,
                moe_intermediate_size=32, head_dim=8, vocab_size=512), 4, 64, 16)
HF_DEFAULT_SEQ_BATCH = (2048, 4)      # --hf-config (--tiny: 64, 16)
MODEL_NAMES = [k for k in GPT_MODELS if k != "tiny"] + list(HF_MODELS)
NATIVE_HF_TYPES = ("llama", "qwen2", "mistral")     # decoder layers of exactly Llama's form


def hf_config(cls_name: str, fields: dict, layers: int, seq: int):
    """A transformers config: ``fields`` and ``layers``, SDPA attention, no KV cache (a training
    forward needs none; with one, each torch.compiled decoder layer recompiles on the cache's
    per-layer state and passes torch's limit of 8 recompilations)."""
    import transformers
    cls = getattr(transformers, cls_name)
    fields = dict(fields, num_hidden_layers=layers, use_cache=False)
    fields["max_position_embeddings"] = max(seq, fields.get("max_position_embeddings", 0),
                                            cls().max_position_embeddings)
    cfg = cls(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def load_hf_config(source: str, layers: Optional[int]):
    """--hf-config: a config.json (a file, or a folder holding one) or the JSON text itself;
    ``layers`` overrides its layer count. SDPA attention, no KV cache (see ``hf_config``)."""
    from transformers import AutoConfig
    if os.path.isdir(source):
        source = os.path.join(source, "config.json")
    if os.path.isfile(source):
        with open(source) as f:
            fields = json.load(f)
    else:
        try:
            fields = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-config {source[:80]!r}: neither a file nor JSON ({exc})") from None
    fields = dict(fields)
    if "model_type" not in fields:
        raise ValueError("--hf-config: the config has no model_type")
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    text = cfg.get_text_config()
    if layers is not None:
        types = getattr(text, "layer_types", None)
        text.num_hidden_layers = layers
        if types:     # per-layer attention kinds (sliding/full): the pattern continued
            text.layer_types = [types[i % len(types)] for i in range(layers)]
    cfg.use_cache = text.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def _hf_class():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM


@dataclass
class ModelSpec:
    """What a run trains: ``kind`` "gpt" (``config`` a GPTConfig; a batch is ``(ids, labels)``,
    labels the next tokens) or "hf" (a transformers config; a batch is ``{"input_ids", "labels"}``
    with labels = ids: the model shifts them, as fxmegatron's trainer feeds HF models).
    ``seq`` tokens per sequence, ``batch`` sequences per step (the global batch)."""
    name: str
    kind: str
    config: Any
    seq: int
    batch: int

    # ---- shapes ----------------------------------------------------------------------------------
    @property
    def text(self):
        return self.config if self.kind == "gpt" else self.config.get_text_config()

    @property
    def layers(self) -> int:
        return self.config.n_layer if self.kind == "gpt" else self.text.num_hidden_layers

    @property
    def hidden(self) -> int:
        return self.config.n_embd if self.kind == "gpt" else self.text.hidden_size

    @property
    def heads(self) -> int:
        return self.config.n_head if self.kind == "gpt" else self.text.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.heads if self.kind == "gpt" else getattr(self.text, "num_key_value_heads", None) or self.heads

    @property
    def head_dim(self) -> int:
        return getattr(self.text, "head_dim", None) or self.hidden // self.heads

    @property
    def vocab(self) -> int:
        return self.config.vocab_size if self.kind == "gpt" else self.text.vocab_size

    @property
    def tied(self) -> bool:
        if self.kind == "gpt":
            return bool(self.config.tie_embeddings)
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def model_type(self) -> str:
        return "gpt" if self.kind == "gpt" else self.config.model_type

    # ---- models --------------------------------------------------------------------------------
    def plain(self, dev, dtype) -> nn.Module:
        """The model on ``dev`` in ``dtype``, seeded: every layout that builds it gets the same weights."""
        torch.manual_seed(0)
        if self.kind == "gpt":
            with torch.device(dev):
                model = GPT(self.config)
            return model.to(dtype)
        with torch.device(dev):
            model = _hf_class().from_config(self.config, dtype=dtype)
        model.train()
        return model

    def meta(self, dtype) -> nn.Module:
        """The model on the meta device (fxmegatron initialises or loads each rank's shards); an HF
        model as fxmegatron's trainer builds it (its non-persistent buffers computed on the CPU)."""
        if self.kind == "gpt":
            with torch.device("meta"):
                return GPT(self.config).to(dtype)
        from fxmegatron.train.models import build_hf
        return build_hf(self.config, dtype)

    @functools.cached_property
    def _shape_model(self) -> nn.Module:
        with torch.device("meta"):
            return GPT(self.config) if self.kind == "gpt" else _hf_class().from_config(copy.deepcopy(self.config))

    def count_params(self) -> int:
        """Parameters of the whole model, a tied weight once."""
        return sum(p.numel() for p in self._shape_model.parameters())

    def module_names(self) -> set:
        return {n for n, _ in self._shape_model.named_modules()}

    def matmul_params(self) -> int:
        """Weights of the model's matmuls: every nn.Linear (and HF Conv1D) module's weight, counted
        per module, so a tied LM head counts though its weight is the embedding's; the embedding
        lookup itself is no matmul. Biases left out."""
        try:
            from transformers.pytorch_utils import Conv1D
        except ImportError:     # pragma: no cover
            Conv1D = nn.Linear
        linear = sum(m.weight.numel() for m in self._shape_model.modules() if isinstance(m, (nn.Linear, Conv1D)))
        return linear + self.active_expert_params()

    def active_expert_params(self) -> int:
        """A mixture of experts' weights as one token uses them: every 3-D parameter led by the
        number of experts E (transformers' stacked experts), times k / E (k experts a token). The
        router's weight (a parameter of transformers' router module, not an nn.Linear: E·h a
        layer) is left out of P."""
        text = self.config.get_text_config() if self.kind == "hf" else None
        E = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
        k = getattr(text, "num_experts_per_tok", None)
        if not E or not k:
            return 0
        total = sum(p.numel() for p in self._shape_model.parameters() if p.dim() == 3 and p.shape[0] == E)
        return total * k // E

    def flops(self) -> float:
        """Model FLOPs of a step (end_to_end.py's docstring): 6·B·s·P + 12·B·l·s²·(heads·head_dim),
        P the matmul weights a token uses (a mixture's experts: k of E)."""
        b, s = self.batch, self.seq
        return 6 * b * s * self.matmul_params() + 12 * b * self.layers * s * s * self.heads * self.head_dim

    # ---- batches and the loss ------------------------------------------------------------------
    def make_batch(self, dev, seed: int = 0):
        """The synthetic batch, random tokens: GPT ``(ids, next tokens)``; HF ``{"input_ids": ids,
        "labels": ids}`` (the model shifts the labels; its loss covers s - 1 tokens a sequence)."""
        g = torch.Generator().manual_seed(seed)
        seq = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)
        if self.kind == "gpt":
            return seq[:, :-1].contiguous().to(dev), seq[:, 1:].contiguous().to(dev)
        ids = seq[:, :-1].contiguous().to(dev)
        return {"input_ids": ids, "labels": ids}

    def loss(self, fn, batch) -> torch.Tensor:
        """The model's own loss of ``batch``: GPT's forward returns it; an HF model's output holds it."""
        return fn(*batch) if self.kind == "gpt" else fn(**batch).loss

    @staticmethod
    def chunk(batch, m: int) -> List[Any]:
        """``batch`` cut in ``m`` microbatches along the batch dim."""
        if isinstance(batch, dict):
            parts = {k: v.chunk(m) for k, v in batch.items()}
            return [{k: parts[k][i] for k in batch} for i in range(m)]
        return list(zip(*(t.chunk(m) for t in batch)))

    def describe(self) -> str:
        what = (f"GPT l={self.layers} h={self.hidden} a={self.heads}" if self.kind == "gpt" else
                f"{type(self.config).__name__} ({self.name}) l={self.layers} h={self.hidden} a={self.heads} "
                f"kv={self.kv_heads} ffn={getattr(self.text, 'intermediate_size', '?')}")
        return (f"{what} s={self.seq} V={self.vocab} ({self.count_params() / 1e6:,.1f} M parameters, "
                f"{'tied' if self.tied else 'untied'})")

    def native_unfit(self) -> Optional[str]:
        """Why native-tpN's plan (torchtitan's Llama plan on HF module names) does not fit, or None."""
        if self.kind == "gpt":
            return None
        if self.model_type not in NATIVE_HF_TYPES:
            return (f"native-tpN applies the Llama plan to HF module names; model_type {self.model_type!r} is not "
                    f"one of {', '.join(NATIVE_HF_TYPES)}")
        names = self.module_names()
        need = ["model.embed_tokens", "model.norm", "lm_head"] + [
            f"model.layers.{i}.{n}" for i in range(self.layers) for n in
            ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        missing = [n for n in need if n not in names]
        return f"native-tpN: the model has no {missing[:3]}" if missing else None


def build_spec(args) -> ModelSpec:
    """The run's model from --model / --hf-config / --tiny and the shape options (end_to_end.py
    has already refused --hidden/--heads for HF models)."""
    if args.hf_config:
        seq, batch = (64, 16) if args.tiny else HF_DEFAULT_SEQ_BATCH
        cfg = load_hf_config(args.hf_config, args.layers)
        if args.vocab is not None:
            cfg.get_text_config().vocab_size = args.vocab
        return ModelSpec("hf-config", "hf", cfg, args.seq or seq, args.global_batch or batch)
    if args.model in HF_MODELS:
        cls, fields, layers, seq, batch = HF_MODELS[args.model]
        if args.tiny:
            tiny, layers, seq, batch = HF_TINY
            fields = dict(fields, **tiny)
        if args.vocab is not None:
            fields = dict(fields, vocab_size=args.vocab)
        seq, batch = args.seq or seq, args.global_batch or batch
        return ModelSpec(args.model, "hf", hf_config(cls, fields, args.layers or layers, seq), seq, batch)
    base = dict(zip(("layers", "hidden", "heads", "seq", "vocab", "global_batch"),
                    GPT_MODELS["tiny" if args.tiny else args.model]))
    val = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    cfg = GPTConfig(vocab_size=val["vocab"], block_size=val["seq"], n_layer=val["layers"], n_head=val["heads"],
                    n_embd=val["hidden"], dropout=0.0, tie_embeddings=False, bias=True)
    return ModelSpec("tiny" if args.tiny else args.model, "gpt", cfg, val["seq"], val["global_batch"])
