"""parallelize(compile=True): each rank's graph through torch.compile (inductor on CPU here).
Equal losses and gradients to the uncompiled graph, dropout included (the key is made
outside the compiled graph, so a new step does not recompile), and a clear error for
fuse=True with compile=True."""
import copy

import pytest
import torch

import fxmegatron
from fxmegatron.runtime.torch_compile import CompileError

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


@pytest.mark.parametrize("fn,args", [
    ("split_seq", (0, 0, 1, "")), ("all_gather_seq", (0, 0, 1, "")), ("gather_seq", (0, 1, "")),
    ("scatter_seq", (0, 1, "")), ("reduce_from_tp", ("",))])
def test_collective_functions_return_new_tensors(fn, args):
    """A view of the input from a collective's autograd Function got a zero gradient under
    compile on CUDA (sequence parallelism's split: wpe stayed frozen). Each returns its own
    storage; only f (copy_to_tp) is the identity, as in Megatron."""
    import fxmegatron.ops.collectives as C
    x = torch.randn(6, 4, requires_grad=True)
    y = getattr(C, fn)(x, *args)
    assert torch.equal(y, x) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
