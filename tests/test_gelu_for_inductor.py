"""``passes.gelu_for_inductor``: under compile=True the tanh GeLU becomes x·σ(2·√(2/π)·(x +
0.044715·x³)) in fp32, the same function (checked in float64 and against ATen's in fp32 and
bf16, forward and backward); erf GeLU and fused groups' GeLUs stay; a compiled GPT trains as
its uncompiled graph does."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fxmegatron
from fxmegatron.passes.gelu_for_inductor import gelu_tanh_through_sigmoid

from . import models

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

aten = torch.ops.aten


def _gelu_graph(approximate, dtype):
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, dtype=dtype, device="meta")
    y = g.call_function(aten.gelu.default, (x,), {"approximate": approximate})
    y.meta["val"] = torch.empty(4, 8, dtype=dtype, device="meta")
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_the_sigmoid_form_is_the_tanh_gelu(dtype, tol):
    gm = _gelu_graph("tanh", dtype)
    assert gelu_tanh_through_sigmoid(gm) == 1
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.gelu.default not in targets and aten.sigmoid.default in targets
    x = (torch.linspace(-9, 9, 32, dtype=torch.float64).reshape(4, 8)).to(dtype).requires_grad_()
    y = gm(x)
    ref = F.gelu(x, approximate="tanh")
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    g = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(4, 8).to(dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    (dref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(dx, dref, rtol=tol, atol=tol)


def test_erf_gelu_is_left_alone():
    gm = _gelu_graph("none", torch.float32)
    assert gelu_tanh_through_sigmoid(gm) == 0
    assert any(n.target is aten.gelu.default for n in gm.graph.nodes)


def _train_alike(plain, compiled, batches):
    """Equal losses and gradients, step by step, on different batches."""
    for b in batches:
        losses = []
        for pm in (plain, compiled):
            for p in pm.parameters():
                p.grad = None
            losses.append(pm(b))
            losses[-1].backward()
        assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-5)
        ref, got = plain.full_grads(), compiled.full_grads()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6)


def _gelus(pm):
    return sum(1 for m in pm.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes if n.target is aten.gelu.default)


def test_only_compile_rewrites_and_a_compiled_gpt_trains_as_its_graph():
    model = models.build("gpt", n_layer=2)
    plain = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"))
    assert _gelus(plain) == 2
    torch._dynamo.reset()
    compiled = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"), compile=True)
    assert _gelus(compiled) == 0
    recomputed = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"), compile=True,
                                        recompute="full")
    assert _gelus(recomputed) == 0                      # inside the recomputed blocks too
    from fxmegatron.passes.fuse import Fused
    fused = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt"), compile=True, fuse=True)
    # the GeLUs are the fused groups', in their generated kernels
    assert [m.label for m in fused.modules() if isinstance(m, Fused)] == ["add -> gelu"] * 2
    _train_alike(plain, compiled, [models.batch("gpt", seed=s) for s in range(2)])


def test_gemma_tanh_gelu_compiled_trains_as_its_graph():
    """Another family: Gemma's GeGLU calls the tanh GeLU (``gelu_pytorch_tanh``)."""
    from .families import FAMILIES, make_batch
    fam = FAMILIES["gemma"]
    model = fam.build(n_layer=1)
    batch = make_batch(fam, 0)
    plain = fxmegatron.parallelize(copy.deepcopy(model), None, batch)
    assert _gelus(plain) == 1
    torch._dynamo.reset()
    compiled = fxmegatron.parallelize(copy.deepcopy(model), None, batch, compile=True)
    assert _gelus(compiled) == 0
    _train_alike(plain, compiled, [make_batch(fam, s + 1) for s in range(2)])
