"""parallelize(compile=True): each rank's graph through torch.compile (inductor on CPU here).
Equal losses and gradients to the uncompiled graph, dropout included (the key is made
outside the compiled graph, so a new step does not recompile), and a clear error for
fuse=True with compile=True."""
import copy

import pytest
import torch

import fxmegatron
from fxmegatron.inductor import CompileError

from . import models


def test_compiled_graph_equals_the_uncompiled_one_and_compiles_once():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = models.build("gpt", dropout=0.1, n_layer=1)
    runs = []
    for compile in (False, True):
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"), compile=compile, seed=5)
        steps = []
        for s in range(3):      # three steps: three dropout keys
            loss = pm(models.batch("gpt", seed=s))
            loss.backward()
            steps.append((loss.item(), {k: g.clone() for k, g in pm.full_grads().items()}))
            for p in pm.parameters():
                p.grad = None
        runs.append(steps)
    for (l0, g0), (l1, g1) in zip(*runs):
        assert l1 == pytest.approx(l0, rel=1e-5)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6)
    assert runs[0][0][0] != runs[0][1][0]                 # the steps differ (dropout, batch)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_and_fuse_together_is_an_error():
    with pytest.raises(CompileError, match="compile=True, fuse=True"):
        fxmegatron.parallelize(models.build("gpt"), None, models.batch("gpt"), compile=True, fuse=True)


def test_the_fused_cross_entropy_stays_one_op_in_the_compiled_graph():
    # under TRITON_INTERPRET=1 (conftest) as on a GPU: dynamo keeps fxmegatron::vocab_ce as a call
    # instead of tracing the unfused fp32 form
    pm = fxmegatron.parallelize(models.build("gpt", n_layer=1), None, models.batch("gpt"))
    graphs = []

    def record(g, example_inputs):
        graphs.append(g.code)
        return g.forward
    pm.graph_module.forward = torch.compile(pm.graph_module.forward, backend=record, dynamic=False)
    pm(models.batch("gpt")).backward()
    assert len(graphs) == 1 and "fxmegatron.vocab_ce" in graphs[0] and "amax" not in graphs[0]


def test_compile_with_tensor_parallelism_is_refused_with_the_reason():
    from fxmegatron.inductor import check_compile_options
    with pytest.raises(CompileError, match=r"tp=2.*did not match"):
        check_compile_options(True, False, 2)
    check_compile_options(True, False, 1)          # tp=1: allowed
    check_compile_options(False, False, 4)         # tp without compile: allowed
