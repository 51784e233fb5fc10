"""``passes.gemm_epilogues``: which linear + GeLU pairs become ``linear_gelu`` (the rule's
preconditions, each refused case), that the compiler runs it only for compiled CUDA programs,
and that every HF family of tests/families.py trains as its plain program with the rewrite
applied (fp32 allowed in, on CPU: there the op is the ATen ops, so this checks the rewrite)."""
import copy

import pytest
import torch
import torch.fx as fx

import fxmegatron
from fxmegatron.ops.gemm_epilogue import linear_gelu
from fxmegatron.passes.gemm_epilogues import apply_gemm_epilogues

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

aten = torch.ops.aten


def _graph(dtype=torch.bfloat16, bias=True, approximate="tanh", extra_reader=False, act=aten.gelu.default):
    g = fx.Graph()

    def ph(name, *shape, dt=dtype):
        n = g.placeholder(name)
        n.meta["val"] = torch.empty(*shape, dtype=dt, device="meta")
        return n
    x, w = ph("x", 2, 4, 8), ph("w", 16, 8)
    b = ph("b", 16) if bias else None
    lin = g.call_function(aten.linear.default, (x, w, b))
    lin.meta["val"] = torch.empty(2, 4, 16, dtype=dtype, device="meta")
    kwargs = {"approximate": approximate} if act is aten.gelu.default else {}
    y = g.call_function(act, (lin,), kwargs)
    y.meta["val"] = lin.meta["val"]
    outs = (y, lin) if extra_reader else (y,)
    g.output(outs)
    return fx.GraphModule(torch.nn.Module(), g)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_biased_linear_read_only_by_a_tanh_gelu_becomes_one_op():
    gm = _graph()
    assert apply_gemm_epilogues(gm) == 1
    assert _targets(gm) == [linear_gelu]
    (n,) = [n for n in gm.graph.nodes if n.target is linear_gelu]
    assert "GELU_AUX_BIAS" in n.meta["gemm_epilogue"]
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    w, b = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(gm(x, w, b)[0], ref)


def _conv1d_graph(second_reader=False):
    """GPT-2's Conv1D as traced: addmm(b, x [t, k], w [k, n]), a view back to [B, T, n], the GeLU."""
    g = fx.Graph()

    def ph(name, *shape):
        n = g.placeholder(name)
        n.meta["val"] = torch.empty(*shape, dtype=torch.bfloat16, device="meta")
        return n
    x, w, b = ph("x", 8, 8), ph("w", 8, 16), ph("b", 16)
    mm = g.call_function(aten.addmm.default, (b, x, w))
    mm.meta["val"] = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    view = g.call_function(aten.view.default, (mm, [2, 4, 16]))
    view.meta["val"] = torch.empty(2, 4, 16, dtype=torch.bfloat16, device="meta")
    y = g.call_function(aten.gelu.default, (view,), {"approximate": "tanh"})
    y.meta["val"] = view.meta["val"]
    g.output((y, mm) if second_reader else (y,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_conv1d_addmm_and_its_view_read_only_by_a_tanh_gelu_become_one_op():
    gm = _conv1d_graph()
    assert apply_gemm_epilogues(gm) == 1
    assert _targets(gm) == [aten.t.default, linear_gelu, aten.view.default]
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    w, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    ref = torch.nn.functional.gelu(torch.addmm(b, x, w).view(2, 4, 16), approximate="tanh")
    torch.testing.assert_close(gm(x, w, b)[0], ref)
    refused = _conv1d_graph(second_reader=True)
    assert apply_gemm_epilogues(refused) == 0


@pytest.mark.parametrize("case", [
    dict(approximate="none"),               # erf GeLU: cuBLASLt's is the tanh form
    dict(bias=False),                       # nothing for the bias epilogue
    dict(dtype=torch.float32),              # fp32 keeps ATen's ops
    dict(extra_reader=True),                # the pre-activation is read elsewhere
    dict(act=aten.relu.default),            # not a GeLU
])
def test_what_the_rule_refuses_stays(case):
    gm = _graph(**case)
    before = _targets(gm)
    assert apply_gemm_epilogues(gm) == 0
    assert _targets(gm) == before


def test_the_compiler_runs_it_for_compiled_cuda_programs_only():
    from fxmegatron.lower.rank_passes import rank_passes
    from fxmegatron.config import ParallelConfig
    from fxmegatron.mesh import Axis
    axes = {"tp": Axis(), "pp": Axis(), "dp": Axis()}
    names = lambda cfg, device: [p.name for p in rank_passes(None, axes, cfg, device)]   # noqa: E731
    assert "gemm_epilogues" in names(ParallelConfig(compile=True), "cuda")
    assert "gemm_epilogues" in names(ParallelConfig(compile=True, fuse=True), torch.device("cuda", 1))
    assert "gemm_epilogues" not in names(ParallelConfig(compile=True), "cpu")
    assert "gemm_epilogues" not in names(ParallelConfig(), "cuda")
    assert "gemm_epilogues" not in names(ParallelConfig(compile=True), None)
    p = names(ParallelConfig(compile=True, fuse=True), "cuda")
    assert p.index("recompute") < p.index("gemm_epilogues") < p.index("fuse")


def test_every_family_with_the_rewrite_is_its_plain_program():
    """Two steps on different batches with masked labels, fp32 on CPU, the GeLU formula rewrite
    (``passes/gelu_formula.py``) and this one applied to the program's graph with fp32 let in:
    GPT-BigCode's gelu_pytorch_tanh MLP is rewritten, and so are the gelu_new formulas of GPT-J
    and Phi (linear) and GPT-2 (its Conv1D's addmm); the families with other activations (erf
    GeLU, SwiGLU, gated GeLU, Bloom's own tanh form) are left as they are, and every loss and
    gradient is the plain program's."""
    from fxmegatron.passes.gelu_formula import gelu_formula_to_op
    from tests.families import FAMILIES, make_batch
    from tests.helpers import assert_same_two_steps
    rewritten = {}
    for name, fam in FAMILIES.items():
        model = fam.build(n_layer=1)
        fused = fxmegatron.parallelize(copy.deepcopy(model), None, make_batch(fam, 0))
        gelu_formula_to_op(fused.graph_module)
        rewritten[name] = apply_gemm_epilogues(fused.graph_module, dtypes=(torch.float32,))
        if not rewritten[name]:
            continue
        plain = fxmegatron.parallelize(copy.deepcopy(model), None, make_batch(fam, 0))
        assert linear_gelu in _targets(fused.graph_module)
        assert_same_two_steps(name, fam, plain, fused)
    assert {n for n, c in rewritten.items() if c} == {"gpt_bigcode", "gpt2", "gptj", "phi"}, rewritten


@pytest.mark.parametrize("name,kwargs", [("gpt", {}), ("gpt", {"sequence_parallel": True, "recompute": "full"}),
                                         ("gpt2", {"sequence_parallel": True})])
def test_under_tensor_parallelism_it_is_the_unmodified_model(name, kwargs):
    """tp=2 (column-parallel first linear: its weight and bias shards, the GeLU on the shard),
    with sequence parallelism and full recompute (the rule inside recomputed regions), and
    GPT-2's Conv1D with its gelu_new formula: three AdamW steps on different batches match the
    unmodified model."""
    from tests.distributed import run_distributed
    from tests.workers.gemm_epilogues import epilogue_parity
    for r in run_distributed(epilogue_parity, 2, name, 3, kwargs):
        assert r["rewritten"] == 2             # one MLP in each of the two blocks
        for a, b in zip(r["losses"], r["losses_ref"]):
            assert abs(a - b) <= 1e-5 * abs(b), (r["losses"], r["losses_ref"])
        bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
        assert not bad, bad
