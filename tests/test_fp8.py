"""``fxmegatron.ops.fp8`` on the CPU, where the GEMMs are emulated.

The quantiser against a float64 reference of "scale, round to the FP8 grid, dequantise" (bit
for bit), saturation, zeros; ``fp8_linear``'s three GEMMs against a float64 reference built
from the recipe table (which operand, which axis, which dtype), shown to tell the table from
its plausible misreadings; the amax reductions under tensor parallelism (each simulated
rank's FP8 operands are exactly slices of the unsplit ones); opcheck and torch.compile. The
GPU tests compare ``torch._scaled_mm`` with the emulation (device machines only).
"""
import threading
from concurrent.futures import ThreadPoolExecutor


import pytest
import torch

import fxmegatron.ops.fp8 as fp8
from fxmegatron.errors import PrecisionError
from fxmegatron.ops.fp8 import E4M3, E5M2, RECIPES, fp8_linear, quantize, saturate
from fxmegatron.ops.groups import SimulatedGroup
from tests.fp8_reference import GRID, RECIPE_NAMES, recipe_kwargs, ref_operands, ref_quantize, wide, within_fp32_sum
from tests.workers.common import rel_err


# ---- the quantiser -------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_is_scale_round_to_grid_dequantize(recipe, dtype):
    x = wide(64, 48, spread=8.0)
    q, s = quantize(x, recipe, dtype)
    ref, ref_s = ref_quantize(x, RECIPES[recipe].rowwise, dtype, RECIPES[recipe].pow2_scales)
    assert q.dtype is dtype and torch.equal(q.double(), ref) and torch.equal(s.double(), ref_s)
    subnormal = q.double().abs() < 2.0 ** GRID[dtype][1]
    assert ((q.double() == 0) & (x != 0)).any() and (subnormal & (q.double() != 0)).any()   # the data spans it all


def test_saturation():
    # e5m2 overflows to inf, e4m3fn (no inf) to NaN or max, whichever torch does: clamp first
    assert torch.isinf(torch.tensor([1e6]).to(E5M2).float()).all()
    x = torch.tensor([1e6, -1e6, 448.0, 500.0, -60000.0])
    assert saturate(x, E4M3).float().tolist() == [448, -448, 448, 448, -448]
    assert saturate(x, E5M2).float().tolist() == [57344, -57344, 448, 512, -57344]
    # amax * fp32(max/amax) can round past max: the element at amax must still be max
    a = torch.rand(2000, generator=torch.Generator().manual_seed(1)) * 10
    over = a[a * (448 / a.double()).float() > 448][:20]
    assert len(over) > 0
    for v in over:
        q, _ = quantize(torch.stack([v, -v, v / 3]).reshape(1, 3), "tensorwise")
        assert q.float()[0, :2].tolist() == [448, -448]


def test_shapes_and_layouts():
    x = torch.randn(2, 8, 32)
    q, s = quantize(x, "tensorwise")
    assert q.shape == (16, 32) and s.shape == () and q.is_contiguous()
    q, s = quantize(x, "rowwise")
    assert q.shape == (16, 32) and s.shape == (16, 1)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)              # powers of two
    qt, st = quantize(x.reshape(16, 32).t(), "rowwise")                    # per column of x
    assert qt.shape == (32, 16) and st.shape == (32, 1) and qt.t().stride() == (1, 16)   # column-major view


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_zeros_quantise_to_zeros(recipe):
    x = torch.zeros(16, 32)
    x[:8] = torch.randn(8, 32)                   # rowwise: eight all-zero rows
    for t in (x, torch.zeros(4, 16)):
        q, s = quantize(t, recipe)
        assert torch.isfinite(s).all() and torch.equal(q.float()[t == 0], torch.zeros_like(t[t == 0]))
    w, b = torch.randn(48, 32, requires_grad=True), torch.randn(48, requires_grad=True)
    xz = torch.zeros(2, 16, 32, requires_grad=True)
    out = fp8_linear(xz, w, b, recipe, "", "")
    assert torch.equal(out, b.detach().expand(2, 16, 48))
    out.backward(torch.zeros_like(out))
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (xz, w, b))


# ---- fp8_linear ----------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_fp8_linear_follows_the_recipe_table(recipe):
    x, w, b, dy = wide(2 * 16, 64, seed=1).reshape(2, 16, 64), wide(48, 64, seed=2), torch.randn(48), \
        wide(32, 48, seed=3).reshape(2, 16, 48)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    out = fp8_linear(xr, wr, br, recipe, "", "")
    out.backward(dy)
    got = [out, xr.grad, wr.grad]
    right = ref_operands(x, w, dy, **recipe_kwargs(recipe))
    for i, (g, (a, bb)) in enumerate(zip(got, right)):
        assert within_fp32_sum(g, a, bb, b if i == 0 else None), f"GEMM {i}"
    assert torch.allclose(br.grad, dy.sum((0, 1)), rtol=1e-6)       # not quantised
    # the reference tells the table from its misreadings
    kw = recipe_kwargs(recipe)
    wrong = {"tensorwise": [dict(kw, grad_dtype=E4M3), dict(kw, rowwise=True)],
             "rowwise": [dict(kw, grad_w_axes="rows"), dict(kw, rowwise=False), dict(kw, grad_dtype=E5M2)]}[recipe]
    for alt in wrong:
        ops = ref_operands(x, w, dy, **alt)
        assert not all(within_fp32_sum(g, a, bb, b if i == 0 else None)
                       for i, (g, (a, bb)) in enumerate(zip(got, ops))), alt


def test_e5m2_gradient_keeps_what_e4m3_flushes():
    """Tensorwise: one scale for the whole output gradient, so its range matters: tokens whose
    gradient is 1e-7 of the largest fall below e4m3's smallest value, not e5m2's."""
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(32, 64, generator=g), torch.randn(32, 48, generator=g)
    x[:16] = 0
    dy[16:] *= 1e-7
    assert (quantize(dy, "tensorwise", E4M3)[0].float()[16:] == 0).all()
    assert (quantize(dy, "tensorwise", E5M2)[0].float()[16:] != 0).float().mean() > 0.99
    w = torch.randn(48, 64, requires_grad=True)
    fp8_linear(x, w, None, "tensorwise", "", "").backward(dy)
    assert rel_err(w.grad, dy.t() @ x) < 0.1      # from the small tokens alone


def test_output_is_no_view():
    """Models modify a linear's output in place (HF Falcon): autograd forbids that on a view
    made inside a custom op, so the op returns none, whatever the input's rank."""
    x, w = torch.randn(2, 16, 32, requires_grad=True), torch.randn(48, 32, requires_grad=True)
    out = fp8_linear(x, w, None, "rowwise", "", "")
    assert out._base is None and out.shape == (2, 16, 48)
    out.mul_(2).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_opcheck(recipe):
    x, w, b = torch.randn(2, 16, 32), torch.randn(48, 32, requires_grad=True), torch.randn(48, requires_grad=True)
    x.requires_grad_()
    for bias, split in ((b, ""), (None, "out"), (b, "tokens")):
        torch.library.opcheck(torch.ops.fxmegatron.fp8_linear.default, (x, w, bias, recipe, "", split))
    torch.library.opcheck(torch.ops.fxmegatron.fp8_linear_backward.default,
                          (torch.randn(2, 16, 48), x.detach(), w.detach(), recipe, "", "in"))


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")
def test_compiles_as_one_opaque_call():
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    backend = AotEagerAndRecordGraphs()
    x, w, b = torch.randn(2, 16, 32, requires_grad=True), torch.randn(48, 32, requires_grad=True), \
        torch.randn(48, requires_grad=True)

    def f(x, w, b):
        return fp8_linear(torch.tanh(x), w, b, "rowwise", "", "").square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    loss = compiled(x, w, b)
    grads = torch.autograd.grad(loss, (x, w, b))
    ref = torch.autograd.grad(f(x, w, b), (x, w, b))
    assert all(torch.equal(g, r) for g, r in zip(grads, ref))

    def calls(graphs, op):
        return sum(1 for g in graphs for n in g.graph.nodes if n.target is op)
    fp8_ops = {torch.ops.fxmegatron.fp8_linear.default, torch.ops.fxmegatron.fp8_linear_backward.default}
    assert calls(backend.fw_graphs, torch.ops.fxmegatron.fp8_linear.default) == 1
    assert calls(backend.bw_graphs, torch.ops.fxmegatron.fp8_linear_backward.default) == 1
    for g in backend.fw_graphs + backend.bw_graphs:     # nothing of the quantisation leaks out
        assert not [n for n in g.graph.nodes if n.op == "call_function" and n.target not in fp8_ops
                    and "amax" in str(n.target)]
    torch._dynamo.reset()


def _cpu_scaled_mm(rowwise: bool = False) -> bool:
    """Whether this torch has a CPU ``torch._scaled_mm`` (with per-row scales: torch 2.11's takes
    per-tensor scales only, and raises an internal assert on [M, 1] ones)."""
    try:
        a = torch.zeros(16, 16).to(E4M3)
        s = (torch.ones(16, 1), torch.ones(1, 16)) if rowwise else (torch.tensor(1.0), torch.tensor(1.0))
        torch._scaled_mm(a, a.t(), *s, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_the_scaled_mm_call_is_the_emulation(recipe):
    """The GPU path's call (operand layouts, scale shapes, fused bias), run by torch's CPU
    ``_scaled_mm``, computes what the emulation computes."""
    if not _cpu_scaled_mm(rowwise=RECIPES[recipe].rowwise):
        pytest.skip(f"this torch's CPU torch._scaled_mm does not take the {recipe} recipe's scales")
    x, w, b = wide(32, 64, seed=4), wide(48, 64, seed=5), torch.randn(48)
    qx, sx = quantize(x, recipe)
    qw, sw = quantize(w, recipe)
    for out_dtype, bias in ((torch.float32, None), (torch.float32, b), (torch.bfloat16, b.bfloat16())):
        got = fp8.scaled_mm(qx, sx, qw.t(), sw.t(), out_dtype, False, bias)
        want = fp8.emulated_mm(qx, sx, qw.t(), sw.t(), out_dtype, False, bias)
        assert got.dtype == want.dtype == out_dtype
        assert rel_err(got.float(), want.float()) < (1e-6 if out_dtype == torch.float32 else 1e-2)


# ---- amaxes under tensor parallelism -------------------------------------------------------------

# dims of each GEMM's operands (a [.., ..] @ b [.., ..]): out = x @ wᵀ, grad_x = dy @ w, grad_w = dyᵀ @ x
GEMM_DIMS = [(("m", "k"), ("k", "n")), (("m", "n"), ("n", "k")), (("n", "m"), ("m", "k"))]
SPLIT_DIM = {"out": "n", "in": "k", "tokens": "m"}


_local = threading.local()
EMULATED_MM = fp8.emulated_mm


def _recording_mm(a, sa, b, sb, *args, **kw):
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.append((a, sa, b, sb))
    return EMULATED_MM(a, sa, b, sb, *args, **kw)


def run_recording(x, w, dy, recipe, group="", split=""):
    """The dequantised operands of the three GEMMs of one fp8_linear forward and backward
    (``emulated_mm`` replaced by ``_recording_mm``)."""
    _local.seen = seen = []
    try:
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        fp8_linear(xr, wr, None, recipe, group, split).backward(dy)
    finally:
        _local.seen = None
    return [(a.double() * sa.double(), b.double() * sb.double()) for a, sa, b, sb in seen]


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("split", ["out", "in", "tokens"])
def test_each_rank_quantises_its_slice_of_the_whole(recipe, split, monkeypatch):
    """Column-, row- and token-split fp8_linear on two simulated ranks: every FP8 operand of
    every GEMM (values and scales) is exactly the slice of the unsplit one. Each half of every
    dim is 2^-20 of the other, so a missing or wrong amax reduction flushes, or keeps, values
    that the unsplit quantisation would not (power-of-two scales hide nothing else)."""
    monkeypatch.setattr(fp8, "emulated_mm", _recording_mm)
    M, K, N = 32, 64, 48

    def halves(t):
        t = t.clone()
        t[t.shape[0] // 2:] *= 2.0 ** -20
        t[:, t.shape[1] // 2:] *= 2.0 ** -20
        return t
    g = torch.Generator().manual_seed(5)
    x, w, dy = (halves(torch.randn(*s, generator=g)) for s in ((M, K), (N, K), (M, N)))
    whole = run_recording(x, w, dy, recipe)
    size = {"m": M, "k": K, "n": N}
    d = SPLIT_DIM[split]

    def part(t, dims, r):
        if d not in dims:
            return t
        n = size[d] // 2
        return t.narrow(dims.index(d), r * n, n)

    group = SimulatedGroup(2)

    def rank(r):
        return run_recording(part(x, ("m", "k"), r), part(w, ("n", "k"), r), part(dy, ("m", "n"), r), recipe,
                             group.name(r), split)
    with ThreadPoolExecutor(2) as pool:
        per_rank = list(pool.map(rank, range(2)))
    for r, ops in enumerate(per_rank):
        for i, ((a, b), (wa, wb), (da, db)) in enumerate(zip(ops, whole, GEMM_DIMS)):
            assert torch.equal(a, part(wa, da, r)), (split, r, i, "left operand")
            assert torch.equal(b, part(wb, db, r)), (split, r, i, "right operand")


# ---- the GPU path (run on a device machine) --------------------------------------------------------

def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs an sm_89+ GPU")
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_scaled_mm_matches_the_emulation_in_bf16(recipe):
    g = torch.Generator().manual_seed(0)
    x, w, b, dy = (torch.randn(*s, generator=g).bfloat16() for s in ((4, 128, 256), (384, 256), (384,), (4, 128, 384)))
    for t in (x, w.t()):    # the device's FP8 cast is the emulation's
        for recipe_ in RECIPE_NAMES:
            assert all(torch.equal(a, c.cpu()) for a, c in zip(quantize(t, recipe_), quantize(t.cuda(), recipe_)))
    res = {}
    for dev in ("cpu", "cuda"):
        xs, ws, bs = (t.detach().to(dev).requires_grad_() for t in (x, w, b))
        out = fp8_linear(xs, ws, bs, recipe, "", "")
        out.backward(dy.to(dev))
        res[dev] = [t.float().cpu() for t in (out, xs.grad, ws.grad, bs.grad)]
    for what, c, d in zip(("out", "grad_x", "grad_w", "grad_b"), res["cpu"], res["cuda"]):
        # same FP8 operands; the sums differ in order (and fast accumulation), then bf16 rounding
        assert rel_err(d, c) < 2e-2, (what, rel_err(d, c))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or _fp8_gpu(), reason="needs a GPU without FP8")
def test_refuses_a_gpu_without_fp8():
    x, w = torch.randn(32, 64, device="cuda"), torch.randn(48, 64, device="cuda")
    with pytest.raises(PrecisionError, match="sm_89"):
        fp8_linear(x, w, None, "tensorwise", "", "")


def _triton_cast_cases(device):
    """(kernel result, eager result) pairs of ``cast_fp8``: one layout, and both (the copy of
    xᵀ rowwise with the column amaxes), for contiguous and transposed operands."""
    from fxmegatron.kernels.fp8_cast import cast_fp8
    from fxmegatron.ops.fp8 import AMAX_FLOOR, E4M3, E5M2, _inverse_scale, saturate
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(70, 50, device=device, generator=g).to(torch.bfloat16) * 40
    x[3] = 0                                                    # a zero row: the amax floor
    x[:, 7] = 0                                                 # a zero column
    for t in (x, x.t()):
        for rowwise, pow2 in ((False, False), (True, True), (True, False), (False, True)):
            for dtype in (E4M3, E5M2):
                def eager(u, dim):
                    amax = torch.linalg.vector_norm(u, float("inf"), dim=dim, keepdim=dim is not None)
                    inv = _inverse_scale(amax.float(), dtype, pow2)
                    return amax, saturate(u.float() * inv, dtype).contiguous(), inv.reciprocal()
                amax, want, want_s = eager(t, 1 if rowwise else None)
                amax_t, want_t, want_st = eager(t.t(), 1 if rowwise else None)
                got, s, none, _ = cast_fp8(t, amax, dtype, pow2, AMAX_FLOOR)
                assert none is None
                yield got, s, want, want_s
                both = cast_fp8(t, amax, dtype, pow2, AMAX_FLOOR, amax_t=amax_t.view(-1), both=True)
                yield both[0], both[1], want, want_s
                yield both[2], both[3], want_t, want_st


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernel in Triton's interpreter")
@pytest.mark.usefixtures("triton_interpreter")
def test_the_triton_cast_computes_the_hosts_scales():
    """``fxmegatron.kernels.fp8_cast`` in the interpreter: the scales (max / amax in float64, a
    power of two from the exponent bits) equal the host's ``_inverse_scale`` exactly, for
    the operand and its transposed copy. Triton's interpreter (3.9) converts fp32 -> FP8 its
    own way (some values land a binade off), so the FP8 bytes are checked on a GPU only (the
    next test)."""
    for got, scale, want, want_scale in _triton_cast_cases("cpu"):
        assert got.is_contiguous() and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(scale, want_scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton cast runs on GPUs only)")
def test_the_triton_cast_writes_the_eager_casts_bytes():
    """On a GPU: the same scales and the same FP8 bytes as the eager cast, for both formats,
    one scale or one per row, powers of two or not, a contiguous or a transposed operand, and
    the transposed copy written in the same pass."""
    for got, scale, want, want_scale in _triton_cast_cases("cuda"):
        assert torch.equal(scale, want_scale)
        assert got.is_contiguous() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
