"""``passes.gelu_formula``: the tanh GeLU written out (HF's gelu_new) becomes ``aten.gelu``
(tanh) where the formula is exactly it, in any operand order, and nowhere else."""
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmegatron.passes.gelu_formula import gelu_formula_to_op

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

aten = torch.ops.aten
C = math.sqrt(2.0 / math.pi)


def hf_gelu_new(x):
    from transformers.activations import NewGELUActivation
    return NewGELUActivation()(x)


def reordered(x):
    return (1.0 + torch.tanh((0.044715 * torch.pow(x, 3.0) + x) * C)) * (x * 0.5)


def truncated_constant(x):      # 0.79788456: the same fp32 number as √(2/π), not the same fp64 one
    return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * torch.pow(x, 3.0))))


def wrong_cubic(x):
    return 0.5 * x * (1.0 + torch.tanh(C * (x + 0.045 * torch.pow(x, 3.0))))


def square_not_cube(x):
    return 0.5 * x * (1.0 + torch.tanh(C * (x + 0.044715 * torch.pow(x, 2.0))))


def bf16_close_cubic(x):       # 0.0447 and 0.044715 are one bf16 number, but ATen computes in fp32
    return 0.5 * x * (1.0 + torch.tanh(C * (x + 0.0447 * torch.pow(x, 3.0))))


def bloom_form(x):              # the same function, another tree of ops: left alone
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def tanh_read_twice(x):
    t = torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0)))
    return 0.5 * x * (1.0 + t), t


def erf_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _rewrite(fn, dtype):
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 8, dtype=dtype))
    return gm, gelu_formula_to_op(gm)


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("fn,dtype", [(hf_gelu_new, torch.float32), (hf_gelu_new, torch.float64),
                                      (hf_gelu_new, torch.bfloat16), (reordered, torch.float32),
                                      (truncated_constant, torch.float32)])
def test_the_formula_becomes_one_gelu(fn, dtype):
    gm, done = _rewrite(fn, dtype)
    assert done == 1 and _ops(gm) == [aten.gelu.default], gm.graph
    x = torch.randn(64, 32, dtype=torch.float64).to(dtype) * 3
    ref = torch.nn.functional.gelu(x.double(), approximate="tanh")
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(gm(x).double(), ref, rtol=tol, atol=tol)
    if dtype != torch.bfloat16:      # the formula itself, op by op, agrees as closely
        torch.testing.assert_close(fn(x).double(), gm(x).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("fn,dtype", [(wrong_cubic, torch.float32), (square_not_cube, torch.float32),
                                      (bloom_form, torch.float32), (tanh_read_twice, torch.float32),
                                      (erf_gelu, torch.float32), (truncated_constant, torch.float64),
                                      (bf16_close_cubic, torch.bfloat16)])
def test_what_is_not_exactly_the_formula_stays(fn, dtype):
    gm, done = _rewrite(fn, dtype)
    assert done == 0 and aten.gelu.default not in _ops(gm)


def test_the_compiler_runs_it_for_compiled_programs_before_the_gelu_passes():
    from fxmegatron.lower.rank_passes import rank_passes
    from fxmegatron.config import ParallelConfig
    from fxmegatron.mesh import Axis
    axes = {"tp": Axis(), "pp": Axis(), "dp": Axis()}
    names = lambda cfg, device: [p.name for p in rank_passes(None, axes, cfg, device)]   # noqa: E731
    assert "gelu_formula" not in names(ParallelConfig(), "cuda")
    assert "gelu_formula" in names(ParallelConfig(compile=True), "cpu")
    p = names(ParallelConfig(compile=True, fuse=True), "cuda")
    assert p.index("recompute") < p.index("gelu_formula") < p.index("gemm_epilogues") < p.index("fuse") \
        < p.index("gelu_for_inductor")
