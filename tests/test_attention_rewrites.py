"""passes/attention_rewrites.py: SDPA's materialised causal mask becomes ``is_causal=True`` and
repeated kv heads become ``enable_gqa=True``, only where the precondition holds, with the
program's numbers unchanged (fp32: loss 1e-5, gradients 1e-4 against the same program without
the rewrites). Families: Llama (GQA), GPT-2 (no GQA), Gemma (MQA-free, head_dim scale),
Falcon (one kv head, broadcast by SDPA itself: nothing to rewrite), Mistral (a sliding window: that mask is not causal and must stay), and a
batch with an attention_mask input (a mask computed from an input must stay)."""
import pytest
import torch

from fxmegatron.passes.attention_rewrites import causal_mask, grouped_kv
from tests.families import FAMILIES, make_batch
from tests.helpers import train_once

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def run(model, batch, rewrite, monkeypatch):
    loss, grads, graph = train_once(model, batch, monkeypatch, None if rewrite else "attention_rewrites")
    return loss, grads, [n for n in graph.nodes if n.target is SDPA]


def check_same(a, b):
    (loss0, grads0, _), (loss1, grads1, _) = a, b
    assert abs(loss0.item() - loss1.item()) <= 1e-5 * abs(loss0.item())
    for name, g in grads0.items():
        assert torch.allclose(g, grads1[name], rtol=1e-4, atol=1e-6), name


def no_padding(fam, seed=3):
    b = make_batch(fam, seed)
    return {"input_ids": b["input_ids"], "labels": b["input_ids"]}


@pytest.mark.parametrize("family,gqa", [("llama", True), ("gpt2", False), ("gemma", False), ("falcon", False),
                                        ("qwen3", True)])
def test_causal_and_grouped(family, gqa, monkeypatch):
    fam = FAMILIES[family]
    model, batch = fam.build(), no_padding(fam)
    before, after = run(model, batch, False, monkeypatch), run(model, batch, True, monkeypatch)
    assert all(n.kwargs.get("attn_mask") is not None or len(n.args) > 3 for n in before[2])
    for n in after[2]:
        assert len(n.args) == 3 and n.kwargs.get("is_causal") is True and "attn_mask" not in n.kwargs, n.format_node()
        assert n.kwargs.get("enable_gqa", False) is gqa
    check_same(before, after)


def test_sliding_window_mask_stays(monkeypatch):
    fam = FAMILIES["mistral"]          # window 8 < sequence 16: not causal
    model, batch = fam.build(), no_padding(fam)
    after = run(model, batch, True, monkeypatch)
    assert all(not n.kwargs.get("is_causal") for n in after[2])
    assert all(n.kwargs.get("enable_gqa") for n in after[2])     # the mask is broadcast over heads
    check_same(run(model, batch, False, monkeypatch), after)


def test_mask_from_an_input_stays(monkeypatch):
    fam = FAMILIES["llama"]
    b = make_batch(fam, 3)
    batch = {"input_ids": b["input_ids"], "attention_mask": (b["labels"] != -100).long(), "labels": b["labels"]}
    model = fam.build()
    after = run(model, batch, True, monkeypatch)
    assert all(not n.kwargs.get("is_causal") for n in after[2])
    check_same(run(model, batch, False, monkeypatch), after)


def sdpa_graph(mask_value, kv_heads=2, repeat=2, dropout=0.0):
    """q [1, kv_heads·repeat, 4, 8]; k, v [1, kv_heads, 4, 8] repeated; a constant mask
    ``mask_value`` (a tensor copied in by ``full``/``tril`` ops, as HF's arange comparisons)."""
    g = torch.fx.Graph()
    h = kv_heads * repeat
    q, k, v = g.placeholder("q"), g.placeholder("k"), g.placeholder("v")
    q.meta["val"] = torch.empty(1, h, 4, 8, device="meta")
    for x in (k, v):
        x.meta["val"] = torch.empty(1, kv_heads, 4, 8, device="meta")
    reps = []
    for x in (k, v):
        u = g.call_function(aten.unsqueeze.default, (x, 2))
        u.meta["val"] = torch.empty(1, kv_heads, 1, 4, 8, device="meta")
        e = g.call_function(aten.expand.default, (u, [1, kv_heads, repeat, 4, 8]))
        e.meta["val"] = torch.empty(1, kv_heads, repeat, 4, 8, device="meta")
        r = g.call_function(aten.reshape.default, (e, [1, h, 4, 8]))
        r.meta["val"] = torch.empty(1, h, 4, 8, device="meta")
        reps.append(r)
    ones = g.call_function(aten.ones.default, ([4, 4],), {"dtype": torch.bool, "device": torch.device("meta")})
    ones.meta["val"] = torch.empty(4, 4, dtype=torch.bool, device="meta")
    mask = g.call_function(aten.tril.default, (ones, mask_value))
    mask.meta["val"] = torch.empty(4, 4, dtype=torch.bool, device="meta")
    out = g.call_function(SDPA, (q, reps[0], reps[1], mask, dropout))
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g), out


def test_preconditions_on_the_graph():
    gm, out = sdpa_graph(0)                    # tril(ones, 0): causal
    assert causal_mask(gm) == 1 and out.kwargs == {"is_causal": True} and len(out.args) == 3
    assert grouped_kv(gm) == 1 and out.kwargs["enable_gqa"] and [a.name for a in out.args[1:]] == ["k", "v"]
    assert not any(n.target in (aten.tril.default, aten.expand.default) for n in gm.graph.nodes)
    gm, out = sdpa_graph(1)                    # tril(ones, 1): one key into the future: not causal
    assert causal_mask(gm) == 0 and out.args[3].target is aten.tril.default
    gm, out = sdpa_graph(0, dropout=0.1)       # dropout: the kv copies stay (its mask is per head)
    assert grouped_kv(gm) == 0
    gm, out = sdpa_graph(0, repeat=1)          # nothing repeated
    assert grouped_kv(gm) == 0


def test_the_causal_check_runs_in_row_blocks_and_sees_every_block():
    from fxmegatron.passes.attention_rewrites import is_causal_value as is_causal
    tril = torch.ones(16, 16, dtype=torch.bool).tril()
    assert is_causal(tril[None, None], 16, 16, rows=4)
    assert is_causal(torch.zeros(16, 16).masked_fill(~tril, float("-inf")), 16, 16, rows=4)
    for i, j in [(13, 14), (13, 2), (0, 1)]:           # a wrong entry in the last, and in the first block
        bad = tril.clone()
        bad[i, j] = not bad[i, j]
        assert not is_causal(bad, 16, 16, rows=4), (i, j)
