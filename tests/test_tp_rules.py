"""Placement rules on one process: every node names the rule that placed it, and a rule
carries every argument of the op it rewrites or says why it cannot (each case here is
also run on gloo in test_tp_rules_parity.py; ``fxmegatron.verify`` checks the numbers
on simulated ranks)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxmegatron import verify
from fxmegatron.io.dump import write_dump
from fxmegatron.ops.vocab_parallel import vocab_parallel_embedding
from fxmegatron.passes.tensor_parallel.rules import RULES, register, rule_for
from fxmegatron.placement import Shard
from tests import models
from tests.helpers import decisions, transform
from tests.test_tp_rules_models import (SPELLINGS, CacheAttention, GqaAttention, Mlp, MoeSharedGate,
                                         PartialKeyAttention, llama, llama_batch)

aten = torch.ops.aten


# ---- task 1: the rule of every node ---------------------------------------------------------

def test_every_node_names_the_rule_that_placed_it(tmp_path):
    _, plan, gm = transform(models.build("llama", n_layer=1), models.batch("llama"), tp=2)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all("tp_rule" in n.meta for n in calls)
    rules = {n.meta["tp_rule"] for n in calls}
    assert {"matmul.column", "matmul.row", "embedding.vocab", "embedding.vocab_loss", "views.view",
            "views.layout", "pointwise", "attention.sdpa", "collective"} <= rules, rules
    assert plan.rules[next(n for n in plan.decisions if plan.decisions[n].kind == "row")] == "matmul.row"
    write_dump(str(tmp_path), gm, {})
    table = (tmp_path / "placements.txt").read_text().splitlines()
    header = next(row for row in table if not row.startswith("#"))
    assert header.split()[:4] == ["node", "op", "placement", "rule"]
    assert any(" S(2) " in row and " matmul.column " in row for row in table)


def test_rule_table_lookup():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    add = g.call_function(aten.add.Tensor, (x, x))
    erf = g.call_function(aten.erf.default, (x,))            # tagged pointwise, registered by no one
    nz = g.call_function(aten.nonzero.default, (x,))
    assert rule_for(add).rule_name == "pointwise" and rule_for(erf).rule_name == "pointwise"
    assert rule_for(nz).rule_name == "opaque"
    assert RULES[aten.mm].rule_name == "matmul" and RULES[aten.view].rule_name == "views.view"
    with pytest.raises(ValueError, match="two placement rules for aten.mm"):
        register(aten.mm)(lambda state, node: None)


# ---- 1. padding_idx ---------------------------------------------------------------------------

def test_padding_idx_is_carried_to_the_owning_rank():
    for rank, local in ((0, 1), (1, None)):
        _, plan, gm = transform(llama(pad=1), llama_batch(0), tp=2, rank=rank)
        emb = next(n for n in gm.graph.nodes if n.target is vocab_parallel_embedding)
        assert emb.args[2:] == (rank * 64, local), emb.args
    verify(llama(pad=1), llama_batch(0), tp=2)


def test_padding_idx_forward_and_gradient_match_aten():
    w = torch.randn(8, 3, requires_grad=True)
    ids = torch.tensor([[1, 5, 1, 6], [0, 1, 7, 4]])
    ref = F.embedding(ids, w, padding_idx=5)
    ref.pow(2).sum().backward()
    parts, outs = [], []
    for start, pad in ((0, None), (4, 1)):   # rank 1 holds rows 4..7, the padding row is its row 1
        part = w.detach()[start:start + 4].requires_grad_()
        outs.append(vocab_parallel_embedding(part, ids, start, pad))
        parts.append(part)
    total = outs[0] + outs[1]
    torch.testing.assert_close(total, ref)
    total.pow(2).sum().backward()
    grads = torch.cat([p.grad for p in parts])
    assert grads[5].abs().max() == 0
    torch.testing.assert_close(grads, w.grad)


@pytest.mark.parametrize("kw,why", [({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
                                    ({"sparse": True}, "sparse")])
def test_embedding_without_vocab_parallel_form_is_replicated(kw, why):
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(128, 16, **kw)
            self.head = nn.Linear(16, 128)

        def forward(self, ids):
            return F.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), ids.flatten())

    _, plan, _ = transform(Emb(), (torch.randint(0, 128, (2, 8)),), tp=2)
    d = decisions(plan)["emb"]
    assert d.kind == "replicated" and why in d.reason and "no vocab-parallel form" in d.reason, d


# ---- 2. a linear tp does not divide stays replicated --------------------------------------------

def test_linear_with_one_output_feature_is_replicated_with_reason():
    model = MoeSharedGate()
    _, plan, _ = transform(model, (torch.randn(2, 8, 32),), tp=2)
    d = decisions(plan)
    assert d["gate"].kind == "replicated", d
    assert "tp=2 does not divide the 1 output features of" in d["gate"].reason and "gate" in d["gate"].reason
    assert d["up"].kind == "column" and d["down"].kind == "row", d
    verify(MoeSharedGate(), (torch.randn(2, 8, 32),), tp=2)


# ---- 3. matmuls against a (transposed) parameter however written ---------------------------------

@pytest.mark.parametrize("spelling", SPELLINGS)
def test_matmul_spellings_are_column_then_row(spelling):
    x = torch.randn(2, 4, 16)
    _, plan, _ = transform(Mlp(spelling), (x,), tp=2)
    kinds = [d.kind for d in plan.decisions.values()]
    assert kinds == ["column", "row"], (spelling, plan.decisions)
    assert plan.param_plc["w1"] == Shard(0) and plan.param_plc["w2"] == Shard(1), plan.param_plc
    verify(Mlp(spelling), (x,), tp=2)


# ---- 4. fewer kv heads than tp -----------------------------------------------------------------

@pytest.mark.parametrize("kv,tp", [(1, 2), (1, 4), (2, 4)])
def test_kv_heads_fewer_than_tp_keep_queries_split(kv, tp):
    _, plan, _ = transform(llama(kv=kv), llama_batch(0), tp=tp)
    d = decisions(plan)
    attn = "model.layers.0.self_attn"
    assert d[f"{attn}.q_proj"].kind == "column" and d[f"{attn}.o_proj"].kind == "row", d
    for p in ("k_proj", "v_proj"):
        assert d[f"{attn}.{p}"].kind == "replicated" and d[f"{attn}.{p}"].reason, d
    sdpa = next(n for n in plan.node_plc if n.target is aten.scaled_dot_product_attention.default)
    assert plan.node_plc[sdpa] == Shard(1) and plan.rules[sdpa] == "attention.sdpa"
    verify(llama(kv=kv), llama_batch(0), tp=tp)


@pytest.mark.parametrize("kv,tp", [(1, 2), (2, 4), (2, 2)])
def test_sdpa_enable_gqa_with_fewer_kv_heads_than_tp(kv, tp):
    model = GqaAttention(kv)
    _, plan, _ = transform(model, (torch.randn(2, 8, 64),), tp=tp)
    d = decisions(plan)
    assert d["q"].kind == "column" and d["o"].kind == "row", d
    assert {d["k"].kind, d["v"].kind} == ({"column"} if kv % tp == 0 else {"replicated"}), d
    verify(GqaAttention(kv), (torch.randn(2, 8, 64),), tp=tp)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_kv_heads_taken_after_the_key_is_reduced(tp, sp):
    # the key is a row-parallel partial sum: g first, then f and this rank's kv heads
    _, plan, _ = transform(PartialKeyAttention(), (torch.randn(2, 8, 64),), tp=tp, sequence_parallel=sp)
    d = decisions(plan)
    assert d["k1"].kind == "column" and d["k"].kind == "row" and d["q"].kind == "column", d
    verify(PartialKeyAttention(), (torch.randn(2, 8, 64),), tp=tp, sequence_parallel=sp)


# ---- 5. a cat with an empty input --------------------------------------------------------------

def test_cat_with_an_empty_cache_keeps_the_split():
    model = CacheAttention()
    x = torch.randn(2, 8, 64)
    _, plan, gm = transform(model, (x,), tp=2)
    d = decisions(plan)
    assert d["qkv"].kind == "column" and d["o"].kind == "row", d
    cats = [n for n in plan.node_plc if n.target is aten.cat.default]
    assert len(cats) == 2 and all(plan.node_plc[c] == Shard(1) for c in cats)
    assert all(len(c.args[0]) == 1 for c in gm.graph.nodes if c.target is aten.cat.default)  # the empty one dropped
    verify(CacheAttention(), (x,), tp=2)


def test_an_opaque_python_function_is_named_without_its_address():
    """placements.txt prints why an op was replicated: a Python function by its qualified name,
    not its repr (whose address differs run to run)."""
    import operator

    from fxmegatron.ops.context_parallel import cp_take
    from fxmegatron.passes.tensor_parallel.rules.opaque import _op_name
    assert _op_name(cp_take) == "fxmegatron.ops.context_parallel.cp_take"
    assert _op_name(operator.getitem) == "_operator.getitem"
    assert _op_name(torch.ops.aten.mm) == "aten.mm"
    assert _op_name(torch.ops.fxmegatron.cp_attention) == "fxmegatron.cp_attention"
