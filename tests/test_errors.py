"""Bad input gets an error that names the place and the constraint."""
import re
import types

import pytest
import torch
import torch.nn as nn

import fxmegatron
from fxmegatron import CaptureError, MeshError, ShardingError
from gpt import GPT, GPTConfig
from tests import models
from tests.helpers import decisions, transform


def _gpt(**kw):
    cfg = dict(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=64)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def _batch(vocab=128):
    ids = torch.randint(0, vocab, (2, 16))
    return (ids, ids)


def test_tp_not_dividing_heads():
    model = _gpt(n_head=6, n_embd=96)     # 96 % 4 == 0 but 6 heads % 4 != 0
    with pytest.raises(ShardingError, match=r"tp=4 does not divide dim 2 \(size 6\).*blocks\.0\.attn"):
        transform(model, _batch(), tp=4)


def test_tp_not_dividing_kv_heads_evenly():
    # fewer kv heads than tp are computed on every rank (tests/test_tp_rules_parity.py), but 3 kv
    # heads over tp=2 would give rank 0 one and a half of them
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=96, num_attention_heads=6,
                                         num_key_value_heads=3, intermediate_size=128, vocab_size=128,
                                         use_cache=False))
    with pytest.raises(ShardingError, match=r"tp=2 does not divide dim 2 \(size 3\).*self_attn.*k_proj"):
        transform(model, models.batch("llama"), tp=2)


def test_tp_not_dividing_vocab():
    with pytest.raises(ShardingError, match=r"tp=2 does not divide the vocabulary \(129 rows of wte.weight\)"):
        transform(_gpt(vocab_size=129), _batch(), tp=2)


def test_tp_not_dividing_hidden():
    # a linear whose output features tp does not divide stays replicated, with the reason
    model = _gpt(n_embd=66, n_head=3)
    _, plan, _ = transform(model, _batch(), tp=4)
    d = decisions(plan)
    for name in ("q", "k", "v", "proj"):
        assert d[f"blocks.0.attn.{name}"].kind == "replicated", d
    assert re.search(r"tp=4 does not divide the 66 output features of .*blocks\.0\.attn\.q",
                     d["blocks.0.attn.q"].reason), d["blocks.0.attn.q"].reason
    assert d["blocks.0.mlp.fc"].kind == "column" and d["blocks.0.mlp.proj"].kind == "row", d


def test_mesh_size_not_world_size():
    mesh = types.SimpleNamespace(mesh_dim_names=("tp",), size=lambda: 4, shape=(4,), device_type="cpu")
    with pytest.raises(MeshError, match=r"mesh \{'tp': 4\} has 4 devices but the world size is 1"):
        fxmegatron.parallelize(_gpt(), mesh, _batch())


def test_mesh_with_unknown_dim():
    mesh = types.SimpleNamespace(mesh_dim_names=("data",), size=lambda: 1, shape=(1,), device_type="cpu")
    with pytest.raises(MeshError, match="needs dims named from"):
        fxmegatron.parallelize(_gpt(), mesh, _batch())


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # DATA-DEPENDENT BRANCH
            y = y * 2
        return y.mean()


def test_untraceable_forward_names_the_line():
    line = next(i for i, l in enumerate(open(__file__).read().splitlines(), 1) if "DATA-DEPENDENT BRANCH" in l
                and "next(" not in l)
    with pytest.raises(CaptureError) as err:
        fxmegatron.parallelize(DataDependent(), None, (torch.randn(2, 8),))
    msg = str(err.value)
    assert "test_errors.py" in msg and f"line {line}" in msg, msg
    assert "DataDependent.forward" in msg and "torch.where" in msg


def test_forward_without_loss():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"logits": self.lin(x)}

    with pytest.raises(CaptureError, match="NoLoss.forward returned dict with no loss"):
        fxmegatron.parallelize(NoLoss(), None, (torch.randn(2, 4),))


def test_batch_structure_mismatch():
    pm = fxmegatron.parallelize(_gpt(), None, _batch())
    with pytest.raises(TypeError, match="batch structure"):
        pm({"tokens": _batch()[0]})


def test_tp_comm_overlap_needs_sequence_parallelism():
    with pytest.raises(ShardingError, match=r"tp_comm_overlap=2.*needs sequence_parallel=True"):
        fxmegatron.parallelize(_gpt(), None, _batch(), tp_comm_overlap=2)
    with pytest.raises(ShardingError, match=r"tp_comm_overlap=-1.*>= 0"):
        fxmegatron.parallelize(_gpt(), None, _batch(), sequence_parallel=True, tp_comm_overlap=-1)
    with pytest.raises(ShardingError, match=r"tp_comm_transport='nvlink'.*'copy_engine'"):
        fxmegatron.parallelize(_gpt(), None, _batch(), sequence_parallel=True, tp_comm_overlap=2,
                               tp_comm_transport="nvlink")
