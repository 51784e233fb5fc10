"""``ops.gemm_epilogue.linear_gelu`` and the cuBLASLt epilogues (``kernels.cublaslt``): each
epilogue against the ATen ops it stands for (CUDA), and the op's forward and backward against
the linear and the GeLU through autograd (CPU and CUDA, eager and compiled)."""
import pytest
import torch
import torch.nn.functional as F

from fxmegatron.kernels import cublaslt
from fxmegatron.kernels.gelu_backward import gelu_tanh_backward_bias
from fxmegatron.ops.gemm_epilogue import CUBIC, TWO_SQRT_2_OVER_PI, gelu_tanh_backward, linear_gelu

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLASLt)")


def _plain(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _leaves(dtype, device, rows=(2, 24), k=32, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device).requires_grad_()
    return r(*rows, k), r(n, k, scale=k ** -0.5), r(n, scale=0.5)


def _grads(fn, leaves, dy):
    for t in leaves:
        t.grad = None
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad.clone() for t in leaves]


def _close(a, b, tol, what):
    """Each element within tol of the reference's scale (a bf16 sum of many rounded terms
    differs from one of unrounded terms by more than a last bit, relative to small elements)."""
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    assert err <= tol * max(scale, 1e-30), f"{what}: max |diff| {err:.3g} > {tol} · max |ref| {scale:.3g}"


def _compare(fn, leaves, tol):
    x = leaves[0]
    dy = torch.randn(*x.shape[:-1], leaves[1].shape[0], dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1)).to(x.dtype).to(x.device)
    y, gs = _grads(fn, leaves, dy)
    y_ref, gs_ref = _grads(_plain, leaves, dy)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    _close(y, y_ref, tol, "output")
    for name, a, b in zip(("x", "w", "b"), gs, gs_ref):
        _close(a, b, tol, f"grad of {name}")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_off_cuda_it_is_the_linear_and_the_gelu(dtype, tol):
    _compare(linear_gelu, _leaves(dtype, "cpu"), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_compiled_it_is_the_linear_and_the_gelu(dtype, tol):
    # the backward's sigmoid form, as torch.compile traces it (no cache: a cached backward is
    # keyed by the graph, not by the Python of the op's backward formula)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        _compare(torch.compile(linear_gelu, fullgraph=True), _leaves(dtype, "cpu"), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_the_sigmoid_form_derivative_is_gelu_backward(dtype, tol):
    x = torch.linspace(-9, 9, 301, dtype=torch.float64).to(dtype)
    dy = torch.linspace(-2, 3, 301, dtype=torch.float64).to(dtype)
    ref = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
    got = gelu_tanh_backward(dy, x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(300, 200), (64, 128), (1, 7)])
def test_the_backward_kernel_is_gelu_backward_and_its_sum(dtype, tol, shape):
    # the Triton kernel (in the interpreter on CPU): rows and columns not multiples of its tiles
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    pre = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(dtype).to(device)
    dact = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    dpre, db = gelu_tanh_backward_bias(dact, pre, TWO_SQRT_2_OVER_PI, CUBIC)
    ref = torch.ops.aten.gelu_backward(dact.double(), pre.double(), approximate="tanh")
    assert dpre.dtype == db.dtype == dtype and db.shape == (shape[1],)
    _close(dpre, ref, tol, "dpre")
    _close(db, ref.sum(0), tol, "db")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_in_bf16_and_fp16_it_is_the_linear_and_the_gelu(compiled, dtype):
    # 2×1000 tokens: not a multiple of a tile. bf16: the epilogue's GeLU reads the unrounded
    # pre-activation (module docstring)
    torch._dynamo.reset()
    fn = torch.compile(linear_gelu, fullgraph=True) if compiled else linear_gelu
    _compare(fn, _leaves(dtype, "cuda", rows=(2, 1000), k=256, n=1024), 1e-2)


def _mm_ref(a, b, epilogue, bias):
    p = a.double() @ b.double()
    if epilogue == "gelu_aux_bias":
        pre = p + bias.double()
        return F.gelu(pre, approximate="tanh"), pre, None
    if epilogue == "bgradb":
        return p, None, a.double().sum(1)
    return p, None, None


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("epilogue", ["default", "gelu_aux_bias", "bgradb", "dgelu_bgrad"])
def test_each_epilogue_is_what_it_replaces(dtype, tol, epilogue):
    torch.backends.cuda.matmul.allow_tf32 = False
    assert cublaslt.available()
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 384, 256, 520
    a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(k, n, device="cuda", generator=g).to(dtype) * k ** -0.5
    if epilogue == "bgradb":            # a weight gradient: a is dyᵀ (a transposed view), b is x
        a = torch.randn(k, m, device="cuda", generator=g).to(dtype).t()
    bias = torch.randn(n, device="cuda", generator=g).to(dtype) if epilogue == "gelu_aux_bias" else None
    aux = torch.empty(m, n, device="cuda", dtype=dtype) if epilogue == "gelu_aux_bias" else None
    if epilogue == "bgradb":
        bias = torch.empty(m, device="cuda", dtype=dtype)
    if epilogue == "dgelu_bgrad":
        aux = torch.randn(m, n, device="cuda", generator=g).to(dtype) * 2
        bias = torch.empty(n, device="cuda", dtype=dtype)
    d = cublaslt.mm(a, b, epilogue, bias=bias, aux=aux)
    assert d is not None and d.shape == (m, n) and d.dtype == dtype
    if epilogue == "dgelu_bgrad":
        ref = torch.ops.aten.gelu_backward((a.double() @ b.double()), aux.double(), approximate="tanh")
        # cuBLASLt's GeLU derivative is not ATen's to the last fp32 bit (seen: 5.5e-5 of 1)
        _close(d, ref, max(tol, 1e-4), "dgelu")
        _close(bias, ref.sum(0), max(tol, 1e-4), "bgrad")
        return
    ref, pre, bgrad = _mm_ref(a, b, epilogue, bias)
    torch.testing.assert_close(d.double(), ref, rtol=tol, atol=tol)
    if pre is not None:
        torch.testing.assert_close(aux.double(), pre, rtol=tol, atol=tol)
    if bgrad is not None:
        torch.testing.assert_close(bias.double(), bgrad, rtol=tol, atol=tol * k ** 0.5)


@cuda
def test_fp32_takes_the_aten_path():
    torch.backends.cuda.matmul.allow_tf32 = False
    _compare(linear_gelu, _leaves(torch.float32, "cuda", rows=(2, 48), k=64, n=128), 2e-6)


@cuda
def test_a_first_call_inside_a_cuda_graph_capture_takes_the_heuristics_pick():
    # choosing an algorithm times candidates and syncs, which a capture forbids: a shape first
    # met inside one runs the heuristic's first algorithm and chooses nothing yet
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 136, 264, 392                       # a shape no other test uses
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda", generator=g).to(torch.bfloat16) * k ** -0.5
    before = len(cublaslt.chosen_algorithms())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        d = cublaslt.mm(a, b)
    graph.replay()
    torch.cuda.synchronize()
    assert d is not None and len(cublaslt.chosen_algorithms()) == before
    torch.testing.assert_close(d.double(), a.double() @ b.double(), rtol=2e-2, atol=2e-2)
    cublaslt.mm(a, b)                             # outside a capture it chooses
    assert len(cublaslt.chosen_algorithms()) == before + 1


@pytest.mark.parametrize("conv1d", [False, True])
def test_the_weight_gradient_arrives_in_the_parameters_layout(conv1d):
    """A Linear's [n, k] weight and a Conv1D's [k, n] one (handed to the op as its transposed
    view): the gradient reaching the parameter is contiguous like it, so autograd keeps it
    instead of copying it into a contiguous tensor (a copy kernel per MLP on a GPU); and it is
    the linear's gradient."""
    x, w, b = _leaves(torch.float64, "cpu")
    param = w.detach().t().contiguous().requires_grad_() if conv1d else w
    weight = (lambda p: p.t()) if conv1d else (lambda p: p)
    seen = []
    param.register_hook(lambda g: seen.append(g.is_contiguous()))
    dy = torch.randn(*x.shape[:-1], w.shape[0], dtype=torch.float64)
    _, (_, gw, _) = _grads(lambda x, p, b: linear_gelu(x, weight(p), b), [x, param, b], dy)
    _, (_, rw, _) = _grads(lambda x, p, b: _plain(x, weight(p), b), [x, param, b], dy)
    assert seen[0], "the weight's gradient is not in the parameter's layout"
    _close(gw, rw, 1e-13, "grad of w")


@cuda
def test_a_conv1d_weight_given_as_its_transposed_view():
    # GPT-2's Conv1D keeps w as [k, n]; passes/gemm_epilogues hands the op w.t(), a view
    x, w, b = _leaves(torch.bfloat16, "cuda", rows=(8, 128), k=256, n=384)
    w_kn = w.detach().t().contiguous().requires_grad_()
    leaves = [x, w_kn, b]
    dy = torch.randn(8, 128, 384, device="cuda", dtype=torch.bfloat16)
    y, (gx, gw, gb) = _grads(lambda x, w_kn, b: linear_gelu(x, w_kn.t(), b), leaves, dy)
    y_ref, (rx, rw, rb) = _grads(lambda x, w_kn, b: _plain(x, w_kn.t(), b), leaves, dy)
    for what, a, ref in (("output", y, y_ref), ("x", gx, rx), ("w", gw, rw), ("b", gb, rb)):
        _close(a, ref, 1e-2, what)
