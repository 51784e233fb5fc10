"""Small models for the placement-rule tests (test_tp_rules.py on one process,
test_tp_rules_parity.py on gloo). No tests here."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 128, 16
SPELLINGS = ("at", "matmul", "linear", "addmm", "mm", "einsum")


def llama(kv=4, pad=None, n_layer=1):
    """HF Llama, 8 query heads of 8, ``kv`` kv heads; ``pad``: config.pad_token_id (the
    embedding's padding_idx)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=n_layer, hidden_size=64, num_attention_heads=8, num_key_value_heads=kv,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=pad))
    return model.train()


def llama_batch(seed, batch=2, pad=1):
    """Random ids with ``pad`` at every third position (so the padding row is looked up)."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    ids[:, seed % 3::3] = pad
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, SEQ), generator=g)}


class Mlp(nn.Module):
    """Two matmuls against parameters, column then row, spelled as ``spelling``:
    ``x @ W.T``, ``torch.matmul(x, W.t())``, ``F.linear``, ``addmm``/``mm`` on ``W.T``
    (on a [b*s, h] view), ``einsum("bsh,oh->bso")``."""

    def __init__(self, spelling, h=16, f=32):
        super().__init__()
        torch.manual_seed(7)
        self.spelling = spelling
        self.w1 = nn.Parameter(torch.randn(f, h) / h ** 0.5)
        self.b1 = nn.Parameter(torch.randn(f) * 0.1)
        self.w2 = nn.Parameter(torch.randn(h, f) / f ** 0.5)
        self.b2 = nn.Parameter(torch.randn(h) * 0.1)

    def lin(self, x, w, b):
        s = self.spelling
        flat = x.reshape(-1, x.shape[-1])
        if s == "at":
            return x @ w.T + b
        if s == "matmul":
            return torch.matmul(x, w.t()) + b
        if s == "linear":
            return F.linear(x, w, b)
        if s == "addmm":
            return torch.addmm(b, flat, w.T).view(*x.shape[:-1], -1)
        if s == "mm":
            return torch.mm(flat, w.T).view(*x.shape[:-1], -1) + b
        if s == "einsum":
            return torch.einsum("bsh,oh->bso", x, w) + b
        raise ValueError(s)

    def forward(self, x):
        return self.lin(F.gelu(self.lin(x, self.w1, self.b1)), self.w2, self.b2).pow(2).mean()


class MoeSharedGate(nn.Module):
    """A shared expert scaled by a gate with one output feature (as in Qwen2-MoE)."""

    def __init__(self, h=32):
        super().__init__()
        torch.manual_seed(3)
        self.up = nn.Linear(h, 2 * h)
        self.down = nn.Linear(2 * h, h)
        self.gate = nn.Linear(h, 1)

    def forward(self, x):
        return (torch.sigmoid(self.gate(x)) * self.down(F.gelu(self.up(x)))).pow(2).mean()


class GqaAttention(nn.Module):
    """Attention with ``kv`` kv heads through SDPA's ``enable_gqa=True`` (no repeat_kv)."""

    def __init__(self, kv, heads=8, h=None):
        super().__init__()
        torch.manual_seed(5)
        h = h or heads * 8
        self.heads, self.kv, self.d = heads, kv, h // heads
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, kv * self.d)
        self.v = nn.Linear(h, kv * self.d)
        self.o = nn.Linear(h, h)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)          # (b, H, s, d)
        k = self.k(x).view(b, s, self.kv, self.d).transpose(1, 2)             # (b, kv, s, d)
        v = self.v(x).view(b, s, self.kv, self.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1)).pow(2).mean()


class CacheAttention(nn.Module):
    """Attention that appends k and v to an empty cache along the sequence (a KV cache
    before its first token): ``cat([empty, k], dim=-2)``."""

    def __init__(self, h=64, heads=4):
        super().__init__()
        torch.manual_seed(9)
        self.heads, self.d = heads, h // heads
        self.qkv = nn.Linear(h, 3 * h)
        self.o = nn.Linear(h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, self.d).transpose(1, 2) for t in self.qkv(x).split(h, -1))
        past = x.new_zeros(b, self.heads, 0, self.d)                         # (b, H, 0, d)
        k = torch.cat([past, k], dim=-2)
        v = torch.cat([past, v], dim=-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, h)).pow(2).mean()


class PartialKeyAttention(GqaAttention):
    """One kv head computed by a column-then-row MLP: the key reaches attention as a partial
    sum, reduced (g) before each rank takes its kv heads."""

    def __init__(self, kv=1, heads=8, h=64):
        super().__init__(kv, heads, h)
        self.k1 = nn.Linear(h, 2 * h)
        self.k = nn.Linear(2 * h, kv * self.d)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k(F.gelu(self.k1(x))).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv, self.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1)).pow(2).mean()
