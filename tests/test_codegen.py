"""Generated Triton kernels for elementwise chains, under TRITON_INTERPRET=1 on CPU:
forward and the symbolically derived backward against eager fp32, on hypothesis shapes
(non-powers of two included)."""
import copy

import pytest  # noqa: E402
import sympy as sp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from fxmegatron.codegen.expr import gelu  # noqa: E402
from fxmegatron.codegen.lower import lower_nodes  # noqa: E402
from fxmegatron.codegen.patterns import REFERENCE_CHAINS  # noqa: E402
from fxmegatron.codegen.fused_chain import FusedChain  # noqa: E402

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


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(CHAINS)), rows=st.integers(1, 9), cols=st.integers(1, 300))
def test_forward_and_backward_match_eager(name, rows, cols):
    ref = CHAINS[name]
    fused = FusedChain(ref.chain, ref.kinds)
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    shape = ref.shape(rows, cols)
    xs = [x.requires_grad_() if x.is_floating_point() else x for x in ref.inputs(shape, generator=g)]
    y = fused.apply(*xs)
    gy = torch.randn(shape, generator=g)
    y.backward(gy)
    xs2 = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in xs]
    y2 = ref.eager(*xs2)
    y2.backward(gy)
    assert _close(y, y2), name
    for a, b in zip(xs, xs2):
        if a.is_floating_point():
            assert _close(a.grad, b.grad), name


def test_tanh_gelu_derivative_has_its_constant():
    fused = FusedChain(CHAINS["bias_gelu_tanh"].chain, CHAINS["bias_gelu_tanh"].kinds)
    assert "0.1070322244" in fused.bwd_src          # 3 * 0.044715 * sqrt(2/pi)
    assert "_fsigmoid" in fused.bwd_src and "_fexp" not in fused.bwd_src.split("def bwd")[1]   # the stable form


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


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_each_reference_chain_at_an_odd_shape(name):
    test_forward_and_backward_match_eager.hypothesis.inner_test(name, 5, 77)


def _dropout_chain(p, shard_dim=-1, start=0, global_shape=()):
    from fxmegatron.codegen.expr import dropout_chain
    from fxmegatron.codegen.chain_source import FULL, KEY
    return FusedChain(dropout_chain(p, 3, global_shape, shard_dim, start), [FULL, KEY])


# (37, 300): one Philox call per four elements; (37, 301): an odd count, one per element
@pytest.mark.parametrize("p,shape", [(0.1, (37, 301)), (0.5, (37, 301)), (0.1, (37, 300))])
def test_kernel_dropout_keep_rate_and_backward_mask(p, shape):
    from fxmegatron.ops.dropout import DropoutRng, keep_mask
    key = DropoutRng(seed=11).next_key("cpu")
    fused = _dropout_chain(p)
    x = (torch.rand(shape) + 0.5).requires_grad_()       # never 0: a zero output means dropped
    y = fused.apply(x, key)
    kept = y != 0
    n = kept.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) <= 3 * sigma
    # the same bits as the unfused counter-based dropout (Philox in torch ops)
    assert torch.equal(kept, keep_mask(key, 3, p, shape, shape))
    assert torch.allclose(y[kept], x.detach()[kept] / (1 - p))
    g = torch.randn(shape)
    y.backward(g)
    # the backward regenerates the forward's mask: zero exactly where dropped
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], g[kept] / (1 - p))


# (3, 40, 24): shards of whole groups of four; (3, 10, 6): shards of 3 and 2 rows of 6
@pytest.mark.parametrize("gshape", [(3, 40, 24), (3, 10, 6)])
def test_kernel_dropout_of_a_shard_is_a_piece_of_the_unsplit_mask(gshape):
    from fxmegatron.placement import Shard, take_shard
    from fxmegatron.ops.dropout import DropoutRng, keep_mask, local_layout
    key = DropoutRng(seed=2).next_key("cpu")
    full = keep_mask(key, 3, 0.3, gshape, gshape)
    for r in range(4):
        d, slices = local_layout(gshape, Shard(1), r, 4)
        fused = _dropout_chain(0.3, d, slices[0][0], gshape)
        x = torch.ones(gshape[0], slices[0][1], gshape[2])
        assert torch.equal(fused.apply(x, key) != 0, take_shard(full, Shard(1), r, 4))


def test_fuse_pass_finds_rotary_and_dropout_groups():
    labels = {}
    for name, kw in (("llama", {}), ("gpt", {"dropout": 0.1})):
        pm = fxmegatron.parallelize(models.build(name, **kw), None, models.batch(name), fuse=True)
        labels[name] = [m.label for k, m in pm.graph_module.named_children() if k.startswith("fused_")]
    assert any("rotate_half" in lb and lb.count("mul") == 2 for lb in labels["llama"]), labels["llama"]
    # the row linear's bias leaves the matmul for the group: bias + dropout + residual add
    assert any(lb == "add -> counter_dropout -> add" for lb in labels["gpt"]), labels["gpt"]


def test_fused_dropout_model_equals_unfused():
    model = models.build("gpt", dropout=0.1)
    b = models.batch("gpt")
    runs = []
    for fuse in (False, True):
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, b, fuse=fuse, seed=3)
        losses = [pm(b) for _ in range(2)]
        losses[-1].backward()
        runs.append(([lo.item() for lo in losses], pm.full_grads()))
    (l0, g0), (l1, g1) = runs
    assert all(abs(a - c) <= 1e-6 * abs(c) for a, c in zip(l1, l0)), (l1, l0)
    for n in g0:
        assert rel_err(g1[n], g0[n], 1e-3) <= 1e-5, n


@settings(max_examples=5, deadline=None)
@given(rows=st.integers(1, 13), vocab=st.sampled_from([3, 130, 2500]))
def test_fused_cross_entropy_matches_eager(rows, vocab):
    """The fused cross-entropy kernels (online log-sum-exp; backward from the saved logits)
    against F.cross_entropy, with ignored targets, over vocabularies longer than a kernel block."""
    from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (4 * torch.randn(rows, vocab, generator=g)).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[::3] = -100
    if (target == -100).all():
        target[-1] = 0
    for reduction, name in ((1, "mean"), (2, "sum")):
        a = logits.detach().clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(a, target, 0, "", reduction)
        loss.backward()
        b = logits.detach().clone().requires_grad_()
        ref = F.cross_entropy(b, target, reduction=name)
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item())), (loss, ref)
        assert _close(a.grad, b.grad, 1e-6), reduction


def test_a_residual_gradient_is_the_incoming_gradient_itself():
    from fxmegatron.codegen.patterns import DROPOUT_P
    ref = REFERENCE_CHAINS["bias_dropout_residual"]
    fused = FusedChain(ref.chain, ref.kinds)
    xs = ref.inputs((6, 8))
    g = torch.randn(6, 8)
    dx0, dbias, dres, _ = fused.backward(xs, [g], [True, True, True, False])
    assert dres is g                                  # no kernel store, no copy
    keep = dx0 != 0
    assert keep.any()
    assert torch.allclose(dx0[keep], g[keep] / (1 - DROPOUT_P))
    assert torch.allclose(dbias, dx0.sum(0), atol=1e-6)


def test_erf_gelu_prints_one_plus_erf_and_keeps_its_negative_tail():
    """``1 + erf`` (GeLU's, forward and derivative) goes through erfc: relative accuracy down the
    negative tail, where eager fp32's 1 + erf(x) cancels to nothing."""
    ref = CHAINS["bias_gelu_erf"]
    fused = FusedChain(ref.chain, ref.kinds)
    for src in (fused.fwd_src, fused.bwd_src):
        assert "_one_plus_erf(" in src and "tl.erf" not in src
    x = torch.linspace(-12.0, 8.0, 4001, dtype=torch.float64)
    want = 0.5 * x * torch.special.erfc(-x / 2 ** 0.5)
    xg = x.float().reshape(1, -1).requires_grad_()
    y = fused.apply(xg, torch.zeros(x.numel(), requires_grad=True))
    # 1.7e-5 measured at x = -12 (the fp32 rounding of the exp's argument, -x²/2); eager: 100%
    assert ((y.double().flatten() - want).abs() / want.abs().clamp_min(1e-30)).max().item() <= 5e-5
    y.backward(torch.ones_like(y))
    dwant = 0.5 * torch.special.erfc(-x / 2 ** 0.5) + x * torch.exp(-x * x / 2) / (2 * torch.pi) ** 0.5
    dx = xg.grad.double().flatten()
    zero = (x + 0.7518).abs() < 0.05      # where the derivative crosses zero: absolute error
    assert ((dx - dwant).abs() / dwant.abs().clamp_min(1e-30))[~zero].max().item() <= 5e-5
    # the erfc fit's 2.3e-6 relative times 0.5·(1 + erf) ≈ 0.23 there: 5.7e-7 measured
    assert (dx - dwant)[zero].abs().max().item() <= 1e-6


def test_broadcast_inputs_and_only_they_are_kept_in_cache():
    """Rotary's cos/sin tables are read by every program: their loads carry evict_last (as
    inductor's do); q, a read-once input, carries no hint; keep_reused=False drops them."""
    ref = REFERENCE_CHAINS["rotary"]
    shapes = [(2, 4, 8, 16), (2, 1, 8, 16), (2, 1, 8, 16)]
    loads = [ln for ln in FusedChain(ref.chain, ref.kinds, shapes).fwd_src.splitlines() if "tl.load(" in ln]
    hinted = {ln.split("=")[0].strip() for ln in loads if "evict_last" in ln}
    assert hinted == {"x1", "x2"}, loads
    plain = FusedChain(ref.chain, ref.kinds)
    plain.keep_reused = False
    plain._example = plain._layout(shapes)
    assert "eviction_policy" not in plain.fwd_src + plain.bwd_src
    bias = REFERENCE_CHAINS["bias_gelu_tanh"]
    assert "eviction_policy" not in FusedChain(bias.chain, bias.kinds).fwd_src
