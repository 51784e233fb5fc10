"""A training step with one microbatch and no data parallelism (``train_step``, ``grad_norm``,
``FusedAdamW.step``, eager and ``compile=True``) never makes the host wait for the GPU: the
host can queue the next step while the GPU runs this one. The first steps' checks of the batch
(``pm.batch_checks``, ``pm.id_checks``: the ids read on the host) do wait, and are documented to;
the step after them is the one measured."""
import copy

import pytest
import torch

import fxmegatron

from . import models


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
@pytest.mark.parametrize("compile", [False, True])
def test_a_step_of_one_microbatch_never_waits_for_the_gpu(compile):
    from fxmegatron.optim import FusedAdamW, clip_coefficient
    model = models.build("gpt").cuda().to(torch.bfloat16)
    batch = tuple(t.cuda() for t in models.batch("gpt"))
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, batch, compile=compile)
    opt = FusedAdamW(pm.parameters(), lr=1e-4)

    def step():
        pm.train_step(batch)
        opt.step(clip_coefficient(pm.grad_norm(), 1.0))
    # lazy set-up (compilation) and the first steps' batch checks may sync
    for _ in range(max(2, pm.batch_checks, pm.id_checks)):
        step()
    assert pm.batch_checks == pm.id_checks == 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
