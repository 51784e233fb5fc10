"""One process: capture on meta, world-size-1 numerics, tied weights, shards and their inverse."""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import fxmegatron
from fxmegatron.capture import capture
from fxmegatron.lower.materialize import init_shard
from fxmegatron.placement import R, Shard, join_shards, take_shard
from tests import models
from tests.helpers import transform


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_world_size_one_matches_exactly(name):
    model = models.build(name)
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(model, None, models.batch(name))
    b = models.batch(name, seed=3)
    lr_, lp = models.call(ref, b), pm(b)
    lr_.backward()
    lp.backward()
    assert abs(lp.item() - lr_.item()) <= 1e-6 * abs(lr_.item())   # same graph as tp>1: vocab-parallel loss
    grads = dict(pm.named_parameters())
    for n, p in ref.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_capture_on_meta_allocates_nothing(name):
    with torch.device("meta"):
        model = models.build(name)
    b = models.batch(name)
    cap = capture(model, b)
    assert all(p.device.type == "meta" for p in cap.params.values())
    assert any(n.op == "get_attr" for n in cap.gm.graph.nodes)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2       # just the batch: weights are get_attr


def test_tied_embedding_and_head_are_one_shard():
    model = models.build("gpt")
    assert model.lm_head.weight is model.wte.weight
    cap, plan, gm = transform(model, models.batch("gpt"), tp=2)
    assert "lm_head.weight" not in cap.params and cap.aliases["lm_head.weight"] == "wte.weight"
    users = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "wte.weight"]
    assert len(users) == 1 and len(users[0].users) == 2        # embedding and LM head
    assert plan.param_plc["wte.weight"] == Shard(0)


def test_full_state_dict_loads_into_unmodified_model():
    model = models.build("gpt")
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"))
    fresh = models.build("gpt")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(pm.full_state_dict(), strict=True)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n


def test_demoted_matmul_is_replicated_with_reason():
    class Odd(nn.Module):
        """A linear whose output is normalised over its features: it cannot be split."""

        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.norm = nn.LayerNorm(16)
            self.down = nn.Linear(16, 8)

        def forward(self, x):
            return self.down(self.norm(self.up(x))).pow(2).mean()

    model = Odd()
    x = torch.randn(4, 8)
    ref = model(x)
    cap, plan, gm = transform(copy.deepcopy(model), (x,), tp=2)
    kinds = {n.meta.get("nn_module_stack") and list(n.meta["nn_module_stack"].values())[-1][0]: d
             for n, d in plan.decisions.items()}
    up = next(d for k, d in kinds.items() if k.endswith("up"))
    down = next(d for k, d in kinds.items() if k.endswith("down"))
    assert up.kind == "replicated" and "normalises over the split dim" in up.reason and "norm" in up.reason
    assert down.kind == "column" or down.kind == "replicated"
    pm = fxmegatron.parallelize(model, None, (x,))
    assert torch.allclose(pm(x), ref)


@settings(max_examples=60, deadline=None)
@given(world=st.sampled_from([1, 2, 4]), nblocks=st.integers(1, 3), per=st.integers(1, 3),
       rows=st.integers(1, 3), dim=st.sampled_from([0, 1]), blocked=st.booleans())
def test_take_and_join_shards_are_inverse(world, nblocks, per, rows, dim, blocked):
    blocks = tuple(world * per * (i + 1) for i in range(nblocks))
    size = sum(blocks)
    shape = [size, rows] if dim == 0 else [rows, size]
    full = torch.arange(size * rows, dtype=torch.float32).reshape(shape)
    plc = Shard(dim, blocks if blocked else None)
    shards = [take_shard(full, plc, r, world) for r in range(world)]
    assert all(s.shape[dim] == size // world for s in shards)
    assert torch.equal(join_shards(shards, plc), full)
    if blocked:   # rank r holds slice r of every block
        first = shards[0].narrow(dim, 0, blocks[0] // world)
        assert torch.equal(first, full.narrow(dim, 0, blocks[0] // world))


@pytest.mark.parametrize("plc", [R, Shard(0), Shard(1), Shard(0, (8, 8, 16))])
def test_direct_shard_init_equals_slice_of_full_init(plc):
    full = init_shard("layer.weight", (32, 24), torch.float32, R, 0, 1, seed=7)
    assert 0.01 < full.std().item() < 0.03
    shards = [init_shard("layer.weight", (32, 24), torch.float32, plc, r, 4 if plc != R else 1, seed=7)
              for r in range(4 if plc != R else 1)]
    assert torch.equal(join_shards(shards, plc), full)
    assert torch.equal(init_shard("ln.weight", (8,), torch.float32, R, 0, 1), torch.ones(8))
    assert torch.equal(init_shard("ln.bias", (8,), torch.float32, R, 0, 1), torch.zeros(8))
