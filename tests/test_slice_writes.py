"""``passes.slice_writes``: a fresh buffer filled by in-place writes into its slices and read
whole becomes one ``cat`` (HF DeepSeek-V3's keys), computing the same tensor; a buffer read
before it is whole, or not tiled by its writes, is left alone. With it, a tiny HF DeepSeek-V3
(multi-head latent attention, routed and shared experts) is exact at tp 2 and 4."""
import pytest
import torch

import fxmegatron
from fxmegatron.capture import capture
from fxmegatron.passes.slice_writes import slice_writes_to_cat

aten = torch.ops.aten


class Filled(torch.nn.Module):
    def __init__(self, split=3, read_early=False, gap=False):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.split, self.read_early, self.gap = split, read_early, gap

    def forward(self, x, y):
        h = self.a(x)                                       # [B, S, 8]
        k = h.new_empty(h.shape[:-1] + (8,))
        k[..., :self.split] = h[..., :self.split]
        early = k.sum() if self.read_early else 0.0
        k[..., self.split + self.gap:] = h[..., :1].double()  # broadcast and cast, as copy_ does
        return ((k * y).sum() + early) if not self.gap else (k[..., :self.split] * y[..., :self.split]).sum()


def _graph_and_inputs(**kw):
    torch.manual_seed(0)
    m = Filled(**kw)
    x, y = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    return m, capture(m, (x, y)), (x, y)


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_buffer_written_slice_by_slice_becomes_a_cat_with_the_same_value():
    m, cap, (x, y) = _graph_and_inputs()
    gm = cap.gm
    assert aten.copy_.default in _ops(gm)
    before = gm(x, y)
    assert slice_writes_to_cat(gm) == 1
    assert aten.copy_.default not in _ops(gm) and aten.new_empty.default not in _ops(gm)
    assert aten.cat.default in _ops(gm) and aten.expand.default in _ops(gm) and aten._to_copy.default in _ops(gm)
    after = gm(x, y)
    assert torch.equal(before[0] if isinstance(before, tuple) else before, after[0] if isinstance(after, tuple)
                       else after)


@pytest.mark.parametrize("kw", [{"read_early": True}, {"gap": True}])
def test_a_buffer_read_before_it_is_whole_or_not_tiled_is_left(kw):
    _, cap, _ = _graph_and_inputs(**kw)
    assert slice_writes_to_cat(cap.gm) == 0
    assert aten.copy_.default in _ops(cap.gm)


def _deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                           topk_group=1, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    return DeepseekV3ForCausalLM(cfg), {"input_ids": x, "labels": x}


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=4), dict(tp=2, dp=2, sequence_parallel=True)])
def test_deepseek_v3_multi_head_latent_attention_is_exact(layout):
    """Before the pass, tp2 failed inside fxmegatron ("the tensor-parallel graph is inconsistent:
    ... A view was created in no_grad mode ..."): the keys' buffer was cut by heads while the
    writes put whole-head values into it."""
    model, batch = _deepseek()
    report = fxmegatron.verify(model, batch, **layout)
    assert report.max_grad_err < 1e-4 and abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref)
    # the up-projection of the keys and values is split by heads (column-parallel, as Megatron's
    # MLA): the shared rotary key beside the heads' keys is this rank's slice, not a reason to
    # keep kv_b_proj whole; the low-rank down-projections stay whole (their norms are over all)
    replicated = [where for where, _, _ in report.coverage.replicated]
    assert not any("kv_b_proj" in w for w in replicated), report.coverage.summary(10)
    why = {w: r for w, _, r in report.coverage.replicated}
    assert any("q_a_proj" in w and "down-projection" in r for w, r in why.items()), report.coverage.summary(10)
