"""An MoE capacity factor (``parallelize(..., moe_capacity_factor=cf)``, Megatron's "probs" drop
policy without padding; passes/expert_parallel/capacity.py, docs/EXPERT_PARALLEL.md).

One process, fp32: HF Mixtral and Qwen2-MoE against the unmodified model whose experts get the
same drops from a hand-written reference (a pre-hook on each experts module multiplies the
routing weights by a keep-mask computed by a Python loop): loss 1e-5, every gradient 1e-4, with
tokens really dropped; with a cf that drops nothing, bitwise the dropless program. On gloo: dp2
at ep2 equals dp2 at ep1 with the same cf (the capacity counts a rank's own tokens, not the
gathered ones). Bad values, a model without experts, the dense dispatch and layouts not built
with it are refused naming the option."""
import copy
import math

import pytest
import torch

import fxmegatron
from fxmegatron.capture import capture
from fxmegatron.errors import ExpertParallelError, ShardingError
from fxmegatron.layout import Layout
from fxmegatron.lower.rank import build_rank
from fxmegatron.ops.moe_capacity import KEEP
from fxmegatron.passes.expert_parallel.capacity import capacity
from tests import models
from tests.distributed import run_distributed
from tests.test_expert_parallel import check_ep_parity
from tests.workers.expert_parallel import ep_parity
from tests.workers.sharded_dp import _model_and_batches

MODELS = ("mixtral", "qwen2_moe")
E, K = 4, 2     # every model here


def _reference_keep(ids, w, num_experts, cap):
    """The rule as docs/EXPERT_PARALLEL.md states it, one expert at a time: its (token, slot)
    pairs by weight, largest first, earlier token first among equals; the first ``cap`` kept."""
    keep = torch.zeros_like(w)
    for e in range(num_experts):
        pairs = [(t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1]) if ids[t, j] == e]
        pairs.sort(key=lambda p: (-w[p].item(), p[0]))
        for p in pairs[:cap]:
            keep[p] = 1
    return keep


def _with_drops(model, cf):
    """``model`` whose experts modules (called as experts(tokens, ids, weights)) see the weights
    times the reference keep-mask; the returned list collects the drops of each call."""
    drops = []

    def hook(mod, args):
        tokens, ids, w = args
        keep = _reference_keep(ids, w.detach(), E, capacity(cf, tokens.shape[0], K, E))
        drops.append(int((keep == 0).sum()))
        return tokens, ids, w * keep

    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(hook)
    return model, drops


def _loss_and_grads(pm, b):
    loss = pm.train_step(b)
    return loss.item(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_capacity_matches_a_hand_written_reference(name):
    model, batch = _model_and_batches(name)
    b = batch(0)
    tokens = b["input_ids"].numel()
    cf = 0.5
    assert capacity(cf, tokens, K, E) * E < tokens * K      # fewer places than assignments: drops are certain
    ref, drops = _with_drops(copy.deepcopy(model), cf)
    loss_ref = models.call(ref, b)
    loss_ref.backward()
    assert drops and all(d > 0 for d in drops), drops
    loss, grads = _loss_and_grads(fxmegatron.parallelize(copy.deepcopy(model), None, b, moe_capacity_factor=cf), b)
    assert abs(loss - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), (loss, loss_ref.item())
    bad = {}
    for n, w in ref.named_parameters():
        err = ((grads[n] - w.grad).abs().max() / w.grad.abs().max().clamp_min(1e-30)).item()
        if err > 1e-4:
            bad[n] = err
    assert not bad, bad
    # the drops change the numbers: the dropless model's gradients are others (tiny models: the
    # loss moves by 1e-5 of itself)
    plain = copy.deepcopy(model)
    models.call(plain, b).backward()
    assert max(((grads[n] - w.grad).abs().max() / w.grad.abs().max()).item()
               for n, w in plain.named_parameters()) > 1e-2


def test_a_capacity_that_drops_nothing_is_the_dropless_program():
    model, batch = _model_and_batches("mixtral")
    b = batch(0)
    loss, grads = _loss_and_grads(fxmegatron.parallelize(copy.deepcopy(model), None, b), b)
    # C = ceil(cf * T * k / E) = T: no expert has more than one assignment per token
    loss_cf, grads_cf = _loss_and_grads(fxmegatron.parallelize(copy.deepcopy(model), None, b,
                                                               moe_capacity_factor=E / K), b)
    assert loss_cf == loss
    assert all(torch.equal(grads_cf[n], g) for n, g in grads.items())


def test_the_keep_mask_is_a_node_of_the_rank_graph():
    model, batch = _model_and_batches("qwen2_moe")
    b = batch(0)
    local = build_rank(capture(model, b), Layout(moe_capacity_factor=0.5), {"dp": 0}, None, {}).local
    keeps = [n for n in local.graph.nodes if n.target is KEEP]
    # one per block: ids, weights, E, and C = ceil(0.5 * T * 2 / 4)
    assert len(keeps) == model.config.num_hidden_layers
    assert all(n.args[2:] == (E, math.ceil(0.5 * b["input_ids"].numel() * K / E)) for n in keeps)


def test_ep2_with_capacity_equals_ep1_with_capacity():
    """dp2: each rank's piece drops the same assignments whether its experts are local (ep1)
    or spread over the ep group (ep2: the masked weights are gathered, not the mask recomputed
    on the gathered tokens)."""
    cf = 0.5
    _, batch = _model_and_batches("mixtral")
    piece = batch(0)["input_ids"].numel() // 2
    assert capacity(cf, piece, K, E) * E < piece * K
    res = run_distributed(ep_parity, 2, {"dp": 2}, ("mixtral",), {"ep": 2, "moe_capacity_factor": cf}, 3,
                          {"moe_capacity_factor": cf})
    check_ep_parity(res, {"dp": 2}, {"ep": 2})      # against the ep1 run with the same capacity
    assert all(r["experts"] and all(s[0] == E // 2 for s in r["experts"].values()) for out in res for r in out.values())


@pytest.mark.parametrize("cf", [0, -1.0, "1.0", True, float("nan")])
def test_a_bad_capacity_factor_is_refused_naming_the_option(cf):
    with pytest.raises(ShardingError, match=r"moe_capacity_factor=.*expected None \(dropless\) or a number > 0"):
        Layout(moe_capacity_factor=cf)


def test_models_and_layouts_capacity_is_not_built_for_are_refused():
    from tests.families import FAMILIES, make_batch
    f = FAMILIES["llama"]
    model = f.build(n_layer=1)
    with pytest.raises(ExpertParallelError, match=r"moe_capacity_factor=0.5\): the model has no mixture-of-experts"):
        fxmegatron.parallelize(model, None, make_batch(f, 0), moe_capacity_factor=0.5)
    llama4, b = _model_and_batches("llama4_text")
    with pytest.raises(ExpertParallelError, match=r"moe_capacity_factor=\.\.\.\) of model\.layers\.\d+\.feed_forward: "
                                                  r"its experts are the dense dispatch"):
        build_rank(capture(llama4, b(0)), Layout(moe_capacity_factor=1.0), {"dp": 0}, None, {})
    for named, kw in {"cp=2": dict(cp=2), "tp=2": dict(tp=2), "pp=2": dict(pp=2), "verify=True": dict(verify=True)}.items():
        with pytest.raises(ShardingError, match=rf"moe_capacity_factor=1.25, {named}\): not built together yet"):
            Layout(moe_capacity_factor=1.25, **kw)
