"""Tiny models for tests: the bundled GPT, HF GPT-2 and HF Llama (GQA), fp32, no dropout."""
import torch

from gpt import GPT, GPTConfig

VOCAB, SEQ, BATCH = 128, 16, 2


def build(name, dropout=0.0, n_layer=2):
    torch.manual_seed(1234)
    if name == "gpt":
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=64,
                              dropout=dropout))
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(
            n_layer=n_layer, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0))
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            num_hidden_layers=n_layer, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
            attention_dropout=dropout, bos_token_id=0, eos_token_id=0, pad_token_id=None))
    else:
        raise ValueError(name)
    model.train()
    return model


def batch(name, seed=0, batch_size=BATCH):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    if name == "gpt":
        return (ids, labels)
    return {"input_ids": ids, "labels": labels}


def call(model, b):
    out = model(**b) if isinstance(b, dict) else model(*b)
    return out if isinstance(out, torch.Tensor) else out.loss
