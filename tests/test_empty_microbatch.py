"""A microbatch whose labels are all ignored (an SFT batch whose answers were cut away) adds
nothing to the step: the loss and gradients are the unmodified model's on the whole batch, not
NaN (issue: 0/0 times a weight of 0), and ``verify`` draws such a microbatch itself."""
import copy
import importlib
import math

import pytest
import torch

import fxmegatron
from fxmegatron.errors import VerificationError
from tests import models
from tests.distributed import run_distributed
from tests.workers.loss_split import MOE, empty_microbatch_pp2, gpt_batch_with_empty_microbatch, moe_batch


def _plain(model, b):
    model.zero_grad()
    loss = model(*b) if isinstance(b, tuple) else model(**b).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(pm, model, b):
    loss_ref, grads_ref = _plain(model, b)
    loss = pm.train_step(b).item()
    assert math.isfinite(loss) and abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
    grads = {n: p.grad for n, p in pm.named_parameters()}
    for n, g in grads_ref.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    held_out = pm.eval_step(b).item()
    assert abs(held_out - loss_ref) <= 1e-5 * abs(loss_ref), (held_out, loss_ref)


def test_gpt_microbatch_with_no_counted_label():
    model, b = models.build("gpt"), gpt_batch_with_empty_microbatch()
    _check(fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2), model, b)


def test_hf_microbatch_with_no_counted_label():
    """HF shifts its labels inside the model: the second microbatch's -100 rows count nothing."""
    model, b = MOE["qwen3_moe"](False), moe_batch(2)
    b["labels"][2:] = -100
    _check(fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2), model, b)


def _weighted_as_before(total, loss, w):
    part = loss.detach() * w
    return part if total is None else total + part


@pytest.mark.parametrize("planted", [False, True])
def test_verify_draws_a_microbatch_with_no_counted_label(monkeypatch, planted):
    """verify's fresh batch masks the last microbatch's labels: the weighting of before (NaN·0)
    is caught there, though the example batch counts tokens in every microbatch."""
    ids, targets = models.batch("gpt", batch_size=4)
    if planted:
        monkeypatch.setattr(importlib.import_module("fxmegatron.verify.pipeline"), "add_weighted", _weighted_as_before)
        with pytest.raises(VerificationError, match=r"loss nan"):
            fxmegatron.verify(models.build("gpt"), (ids, targets), tp=2, microbatches=2)
    else:
        report = fxmegatron.verify(models.build("gpt"), (ids, targets), tp=2, microbatches=2)
        assert math.isfinite(report.loss), report


def test_pipeline_microbatch_with_no_counted_label_on_gloo():
    for loss, loss_ref, errs in run_distributed(empty_microbatch_pp2, 2):
        assert math.isfinite(loss) and abs(loss - loss_ref) <= 1e-5 * abs(loss_ref), (loss, loss_ref)
        assert errs and max(errs.values()) <= 1e-4, {k: v for k, v in errs.items() if v > 1e-4}
