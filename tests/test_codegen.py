"""Generated Triton kernels for elementwise chains, under TRITON_INTERPRET=1 on CPU:
forward and the symbolically derived backward against eager fp32, on hypothesis shapes
(non-powers of two included)."""
import copy

import pytest  # noqa: E402
import sympy as sp  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from fxmegatron.codegen.expr import gelu, lower_nodes  # noqa: E402
from fxmegatron.codegen.patterns import REFERENCE_CHAINS  # noqa: E402
from fxmegatron.codegen.triton_kernel import ROW, FusedChain  # noqa: E402

import fxmegatron  # noqa: E402
from tests import models  # noqa: E402
from tests.workers import rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    # read when a kernel is decorated (generated kernels are made inside the tests) and when
    # a fused group is called (it then runs its kernels on CPU tensors)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


x0, x1 = sp.symbols("x0 x1", real=True)
CHAINS = REFERENCE_CHAINS


def _close(a, b, tol=1e-5):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item() <= tol


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(sorted(CHAINS)), rows=st.integers(1, 9), cols=st.integers(1, 300))
def test_forward_and_backward_match_eager(name, rows, cols):
    chain, kinds, ref = CHAINS[name]
    fused = FusedChain(chain, kinds, block=128)
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    a = (torch.randn(rows, cols, generator=g) * 3).requires_grad_()
    b = torch.randn(cols if kinds[1] == ROW else (rows, cols), generator=g).requires_grad_()
    y = fused.apply(a, b)
    gy = torch.randn(rows, cols, generator=g)
    y.backward(gy)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y2 = ref(a2, b2)
    y2.backward(gy)
    assert _close(y, y2)
    assert _close(a.grad, a2.grad)
    assert _close(b.grad, b2.grad)


def test_tanh_gelu_derivative_has_its_constant():
    fused = FusedChain(*CHAINS["bias_gelu_tanh"][:2])
    assert "0.1070322244" in fused.bwd_src          # 3 * 0.044715 * sqrt(2/pi)
    assert "tl.sigmoid" in fused.bwd_src and "tl.exp" not in fused.bwd_src   # the stable form


def test_lowering_from_a_graph():
    def f(x, b):
        return torch.ops.aten.gelu.default(torch.ops.aten.add.Tensor(x, b), approximate="tanh")

    gm = torch.fx.symbolic_trace(f)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    chain = lower_nodes(body, ph, [body[-1]])
    assert sp.simplify(chain.outputs[0] - gelu(x0 + x1, "tanh")) == 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fused_model_matches_unmodified(name, tmp_path):
    model = models.build(name, n_layer=2)
    b = models.batch(name)
    ref = copy.deepcopy(model)
    loss_ref = models.call(ref, b)
    loss_ref.backward()
    pm = fxmegatron.parallelize(model, None, b, fuse=True)
    fused = [m for k, m in pm.graph_module.named_children() if k.startswith("fused_")]
    assert fused, "no group was fused"
    loss = pm(b)
    loss.backward()
    assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
    scale = 0.01 * max(p.grad.abs().max().item() for p in ref.parameters())
    grads = pm.full_grads()
    for n, p in ref.named_parameters():
        assert rel_err(grads[n], p.grad, scale) <= 1e-4, n
    pm.dump(str(tmp_path))
    src = (tmp_path / "rank0" / "fused_0.triton.py").read_text()
    assert "@triton.jit" in src and "def bwd(" in src
