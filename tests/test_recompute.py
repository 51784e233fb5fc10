"""Recompute pass, one process: numerics, which nodes are recomputed, RNG replay."""
import copy

import pytest
import torch

import fxmegatron
from fxmegatron.passes.recompute import RecomputePolicy
from tests import models


def _grads(pm):
    return {n: p.grad.clone() for n, p in pm.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_recompute_matches_and_dump_shows_regions(name, mode, tmp_path):
    model = models.build(name, dropout=0.1)
    b = models.batch(name)
    results = []
    for rc in ("none", mode):
        torch.manual_seed(7)
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, b, recompute=rc)
        torch.manual_seed(11)
        loss = pm(b)
        loss.backward()
        results.append((loss.detach(), _grads(pm), pm))
    (l0, g0, _), (l1, g1, pm) = results
    # dropout > 0: the recomputed masks are the forward's, so results are bitwise equal
    assert torch.equal(l0, l1)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    regions = [m for k, m in pm.graph_module.named_children() if k.startswith("recompute_")]
    assert len(regions) == 2                         # one per layer
    pm.dump(str(tmp_path))
    body = (tmp_path / "rank0" / "recompute_0.py").read_text()
    assert "scaled_dot_product_attention" in body or "counter_dropout_attention" in body
    if mode == "full":   # the whole block: both norms and all its matmuls
        assert body.count("linear") + body.count("addmm") + body.count(".mm.") >= 4
    else:
        assert "linear" not in body and "addmm" not in body
    assert f"[recompute: {mode}]" in (tmp_path / "rank0" / "placements.txt").read_text()


def test_policy_by_module_pattern():
    model = models.build("gpt")
    pm = fxmegatron.parallelize(model, None, models.batch("gpt"),
                                recompute=RecomputePolicy(modules=(r"\.mlp$",), name="mlp"))
    regions = [m for k, m in pm.graph_module.named_children() if k.startswith("recompute_")]
    assert len(regions) == 2 and all("gelu" in m.body.code for m in regions)


def test_bad_recompute_mode():
    with pytest.raises(ValueError, match="recompute='some'"):
        fxmegatron.parallelize(models.build("gpt"), None, models.batch("gpt"), recompute="some")
