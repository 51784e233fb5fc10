"""A step that splits the batch (microbatches, dp) computes the unmodified model's loss on the
whole batch, or ``parallelize`` refuses it by name (issue: an MoE's load-balancing loss was
weighted as if it were the cross-entropy; a microbatch with no counted label made the loss NaN)."""
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmegatron
from fxmegatron.capture import capture
from fxmegatron.errors import LossError, VerificationError
from fxmegatron.passes.loss_terms import split_loss_problem
from tests.distributed import run_distributed
from tests.workers.loss_split import MOE, loss_and_grads, moe_batch, split_moe


def _close(pm, model, b, loss):
    loss_ref, grads_ref = loss_and_grads(model, b)
    assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), (loss.item(), loss_ref.item())
    grads = {n: p.grad for n, p in pm.named_parameters()}
    for n, g in grads_ref.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", sorted(MOE))
def test_router_loss_is_refused_by_name_when_the_batch_is_split(name):
    with pytest.raises(LossError, match=r"node add_\w* \(aten\.add_\) at the top level .*router_aux_loss_coef \* "
                                        r"aux_loss.*model\.layers\.0\.\w+\.(gate|router).*output_router_logits=False"):
        fxmegatron.parallelize(MOE[name](True), None, moe_batch(0), microbatches=2)
    # the batch not split: the model's loss, router term included
    model, b = MOE[name](True), moe_batch(1)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b)
    _close(pm, model, b, pm.train_step(b))


@pytest.mark.parametrize("name", sorted(MOE))
def test_without_the_router_loss_two_microbatches_are_the_whole_batch(name):
    model, b = MOE[name](False), moe_batch(1)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2)
    _close(pm, model, b, pm.train_step(b))


@pytest.mark.parametrize("name", sorted(MOE))
def test_router_loss_at_tp2_is_the_model_s_and_split_by_pp2_tp2_named(name):
    """Tensor parallelism does not split the batch: the router's loss keeps its value (the router
    replicated, the experts split); pp2 × tp2 with 2 microbatches does split it, and verify names
    the term (parallelize refuses it: the tests above)."""
    report = fxmegatron.verify(MOE[name](True), moe_batch(1), tp=2)
    assert abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref), report
    assert report.max_grad_err < 1e-4, report
    with pytest.raises(VerificationError, match=r"verify tp=2 pp=2 m=2 .*not additive over microbatches"):
        fxmegatron.verify(MOE[name](True), moe_batch(0), tp=2, pp=2, microbatches=2)


def test_verify_names_the_term_that_is_not_additive():
    with pytest.raises(VerificationError, match=r"not additive over microbatches.*node add_ .*the term, mul_\d+"):
        fxmegatron.verify(MOE["qwen3_moe"](True), moe_batch(0), tp=1, microbatches=2)


class _Head(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.emb, self.head, self.loss = nn.Embedding(16, 8), nn.Linear(8, 16), loss

    def forward(self, ids, labels):
        return self.loss(self, self.head(self.emb(ids)).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("loss, why", [
    (lambda m, x, y: F.cross_entropy(x, y) * 0.5, None),
    (lambda m, x, y: (F.cross_entropy(x, y) / 3).to(torch.float64), None),
    (lambda m, x, y: F.cross_entropy(x, y) + 1e-3 * m.head.weight.pow(2).sum(), r"adds a term .*computed from head.weight"),
    (lambda m, x, y: F.cross_entropy(x, y) + 1e-3 * torch.logsumexp(x, -1).pow(2).mean(), r"adds a term"),
    (lambda m, x, y: F.cross_entropy(x, y, reduction="sum"), r"reduced by sum"),
    (lambda m, x, y: F.cross_entropy(x, y, weight=torch.ones(16)), r"class weights"),
    (lambda m, x, y: F.mse_loss(x, F.one_hot(y, 16).float()), r"not a cross-entropy"),
    (lambda m, x, y: F.cross_entropy(x, y) * x.mean(), r"not its cross-entropy cross_entropy_loss alone"),
])
def test_which_losses_split_exactly(loss, why):
    ids = torch.randint(0, 16, (4, 5))
    problem = split_loss_problem(capture(_Head(loss), (ids, ids.clone())).gm)
    if why is None:
        assert problem is None, problem
    else:
        assert problem is not None and re.search(why, problem), problem


def test_moe_router_loss_on_gloo_dp2_and_pp2():
    """dp2 and pp2 with 2 microbatches refuse the router loss; dp2 without it is the plain model."""
    (r0, r1) = run_distributed(split_moe, 2, "granite_moe")
    for r in (r0, r1):
        assert r["dp2"] and "parallelize(microbatches=2 and dp=2)" in r["dp2"] and "node add_" in r["dp2"], r["dp2"]
        assert r["pp2"] and "microbatches=2" in r["pp2"] and "node add_" in r["pp2"], r["pp2"]
        assert abs(r["loss"] - r["loss_ref"]) <= 1e-5 * abs(r["loss_ref"]), r
        assert r["grad_err"] <= 1e-4, r


def test_a_loss_tp_leaves_unsplit_is_weighted_by_its_tokens_too():
    """Label smoothing keeps ATen's cross-entropy (no vocab-parallel form): its microbatches are
    weighted by their counted labels as well (1/m before, wrong for uneven counts)."""
    model = _Head(lambda m, x, y: F.cross_entropy(x, y, label_smoothing=0.1))
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, (ids, labels), microbatches=2)
    loss, want = pm.train_step((ids, labels)).item(), model(ids, labels).item()
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
