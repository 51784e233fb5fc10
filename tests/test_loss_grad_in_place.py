"""passes/loss_grad_in_place.py: where nothing but the loss reads the logits, the fused
cross-entropy's backward writes the gradient over them (one logits-sized tensor less at the
peak) and every number stays the same, bit for bit; where something else might read them
(the logits are a graph output, or come from an op whose backward saves its output) the
backward stays out of place."""
import pytest
import torch

from fxmegatron.kernels.cross_entropy import vocab_ce
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.loss_grad_in_place import loss_grad_reuses_logits
from tests.families import FAMILIES, make_batch
from tests.helpers import train_once

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

aten = torch.ops.aten


def run(model, batch, rewrite, monkeypatch, **kw):
    loss, grads, graph = train_once(model, batch, monkeypatch, None if rewrite else "loss_grad_reuses_logits", **kw)
    return loss, grads, [n for n in graph.nodes if n.target is vocab_parallel_cross_entropy]


@pytest.mark.parametrize("family,dtype,kw", [("gpt2", torch.bfloat16, {}), ("llama", torch.float32, {}),
                                             ("qwen2", torch.bfloat16, {"microbatches": 2}),
                                             ("llama", torch.float32, {"compile": True})])
def test_same_numbers_with_the_gradient_in_place(family, dtype, kw, monkeypatch):
    fam = FAMILIES[family]
    model = fam.build().to(dtype)
    batch = make_batch(fam, seed=5, batch_size=4)
    loss0, grads0, ce0 = run(model, batch, False, monkeypatch, **kw)
    loss1, grads1, ce1 = run(model, batch, True, monkeypatch, **kw)
    assert ce1[0].kwargs.get("reuse_logits") is True and not ce0[0].kwargs.get("reuse_logits")
    assert torch.equal(loss0, loss1)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name


def test_the_gradient_is_the_logits_storage():
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # the kernel runs where the tensors are
    x = torch.randn(6, 10, requires_grad=True, device=dev)
    t = torch.randint(0, 10, (6,), device=dev)
    for reuse in (False, True):
        logits = x * 1.0          # a fresh tensor, as a matmul's output
        seen = []
        logits.register_hook(lambda g: seen.append(g))
        loss, _ = vocab_ce(logits, t, torch.ones(6, dtype=torch.bool, device=dev), "", reuse)
        loss.sum().backward()
        assert (seen[0].data_ptr() == logits.data_ptr()) is reuse
        if not reuse:
            expected = seen[0].clone()
    assert torch.equal(seen[0], expected)


@pytest.mark.parametrize("pad", [0, 7])
def test_the_gradient_lands_on_each_row_of_logits_whose_rows_are_padded(pad):
    # under compile=True inductor pads the row stride of logits whose V is not a multiple of its
    # alignment (GPT-2's 50257); the in-place backward once wrote row r at r·V, not at the row's
    # own stride: a gradient norm 26 000 times the true one on an H100 (session 19)
    from fxmegatron.kernels.cross_entropy import vocab_ce_backward, vocab_ce_backward_
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # the CPU runs the kernel interpreted
    n, v = 5, 2100                                           # V over two of the kernel's column blocks
    buf = torch.randn(n, v + pad, device=dev)
    logits = buf[:, :v]
    t = torch.randint(0, v, (n,), device=dev)
    lse = torch.logsumexp(logits, 1)
    g = torch.rand(n, device=dev)
    expected = vocab_ce_backward(logits, t, lse, g)
    vocab_ce_backward_(logits, t, lse, g)
    assert torch.equal(logits, expected)


def graph(producer, output_logits=False, width=32):
    g = torch.fx.Graph()
    h, w, y = g.placeholder("h"), g.placeholder("w"), g.placeholder("y")
    logits = g.call_function(aten.mm.default, (h, w)) if producer == "mm" else g.call_function(aten.tanh.default, (h,))
    view = g.call_function(aten.view.default, (logits, [-1, width]))
    for node, shape in ((logits, (4, width)), (view, (4, width))):
        node.meta["val"] = torch.empty(shape, device="meta")
    loss = g.call_function(vocab_parallel_cross_entropy, (view, y, 0, "0", 1, -100))
    g.output((loss, logits) if output_logits else (loss,))
    return torch.fx.GraphModule(torch.nn.Module(), g), loss


def test_precondition_on_the_graph():
    gm, loss = graph("mm")
    assert loss_grad_reuses_logits(gm) == 1 and loss.kwargs == {"reuse_logits": True}
    for gm, loss in (graph("tanh"), graph("mm", output_logits=True)):   # tanh saves its output
        assert loss_grad_reuses_logits(gm) == 0 and loss.kwargs == {}
    # rows not a multiple of 128 bytes (8 fp32 columns; 32 split over tp=2): inductor may pad them
    for gm, loss, tp in ((*graph("mm", width=8), 1), (*graph("mm"), 2)):
        assert loss_grad_reuses_logits(gm, tp) == 0 and loss.kwargs == {}


def test_compiled_with_padded_matmuls_an_unaligned_vocabulary_keeps_exact_gradients(monkeypatch):
    """On CUDA, inductor's pad_mm pads the LM head's matmul when the vocabulary is unaligned
    (GPT-2's 50257) after AOT autograd functionalized the in-place backward; with the backward
    in place the gradients were wrong on an H100 (norm 42023.9 against 1.58). Here pad_mm is
    forced on the CPU: an unaligned vocabulary must keep the out-of-place backward, and the
    compiled gradients must be the uncompiled ones. (With the in-place backward let in at any
    width, 6% of one gradient's elements differ here.)"""
    import copy

    import fxmegatron
    pad_mm = pytest.importorskip("torch._inductor.fx_passes.pad_mm")
    if not all(hasattr(pad_mm, a) for a in ("check_device", "has_triton")):
        pytest.skip("this torch's pad_mm has no check_device/has_triton to force it on CPU")
    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    fam = FAMILIES["gpt2"]
    model = fam.build(n_layer=1, vocab_size=2053)
    with torch._inductor.config.patch(force_shape_pad=True, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        plain = fxmegatron.parallelize(copy.deepcopy(model), None, make_batch(fam, 0))
        compiled = fxmegatron.parallelize(copy.deepcopy(model), None, make_batch(fam, 0), compile=True)
        batch = make_batch(fam, 1)
        grads = []
        for pm in (plain, compiled):
            for p in pm.parameters():
                p.grad = None
            pm(batch).backward()
            grads.append(pm.full_grads())
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
