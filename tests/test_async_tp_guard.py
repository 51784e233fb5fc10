"""The refusal of a tensor-parallel step in a process where torch's async TP is on
(``runtime/async_tp_guard.py``; the wrong gradients it guards against are in docs/TRAINING.md):
when it applies (CUDA, tp > 1, inductor's ``_micro_pipeline_tp`` on, no override) and that
``ParallelModel`` asks before every step."""
import copy

import pytest
import torch
import torch._inductor.config as inductor_config

import fxmegatron
from fxmegatron.runtime import async_tp_guard
from fxmegatron.runtime.async_tp_guard import ALLOW, AsyncTPBesideError, async_tp_refusal
from tests import models


def test_the_refusal_applies_to_tensor_parallel_cuda_steps_with_the_flag_on(monkeypatch):
    monkeypatch.delenv(ALLOW, raising=False)
    # inductor's own patch (monkeypatch's undo deletes a config module's attribute)
    with inductor_config.patch(_micro_pipeline_tp=False):
        assert async_tp_refusal("cuda", 2) is None
    with inductor_config.patch(_micro_pipeline_tp=True):
        why = async_tp_refusal("cuda", 2)
        assert why and "_micro_pipeline_tp" in why and "tp=2" in why and ALLOW in why
        assert async_tp_refusal("cuda", 1) is None        # no tensor-parallel collectives
        assert async_tp_refusal("cpu", 4) is None         # gloo: no symmetric memory, no async-TP ops
        monkeypatch.setenv(ALLOW, "1")
        assert async_tp_refusal("cuda", 2) is None


def test_a_step_asks_first(monkeypatch):
    """A one-process model made to look like a tp2 CUDA one to the guard: train_step, forward and
    eval_step raise before running anything; with the flag off the same step trains."""
    monkeypatch.delenv(ALLOW, raising=False)
    model = models.build("gpt")
    b = models.batch("gpt", batch_size=2)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b)
    seen = []
    real = async_tp_guard.async_tp_refusal
    monkeypatch.setattr(async_tp_guard, "async_tp_refusal",
                        lambda device_type, tp: seen.append((device_type, tp)) or real("cuda", 2))
    with inductor_config.patch(_micro_pipeline_tp=True):
        for call in (pm.train_step, pm.eval_step, lambda x: pm(*x)):
            with pytest.raises(AsyncTPBesideError, match="async tensor parallelism is on"):
                call(b)
    assert seen and all(s == ("cpu", 1) for s in seen), seen     # the model's own device and tp
    assert all(p.grad is None for p in pm.parameters())
    loss = pm.train_step(b)
    ref = models.call(model, b)
    assert torch.allclose(loss, ref, rtol=1e-5), (loss, ref)
