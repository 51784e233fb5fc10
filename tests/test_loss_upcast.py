"""passes/loss_upcast.py: a model that upcasts its logits to fp32 only for the loss (HF's
``logits.float()``) gets a loss that reads the bf16 logits and returns fp32: on the CPU the same
loss and gradients bit for bit, without the fp32 copy of the [N, V] logits (on a GPU to rounding,
see the GPU test). Checked on families with different heads (tied GPT-2, untied Llama, Gemma2's
soft-capped logits, Qwen2), and the precondition's refusals: an fp32 model, an fp32 copy that
something besides the loss reads."""
import pytest
import torch

from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.loss_upcast import loss_reads_logits_dtype
from tests.families import FAMILIES, make_batch
from tests.helpers import train_once

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

aten = torch.ops.aten


def run(model, batch, rewrite, monkeypatch):
    loss, grads, graph = train_once(model, batch, monkeypatch, None if rewrite else "loss_reads_logits_dtype")
    return loss, grads, [n for n in graph.nodes if n.target is vocab_parallel_cross_entropy]


def fp32_casts(nodes):
    return [n for n in nodes if n.op == "call_function" and n.target in (aten.to.dtype, aten._to_copy.default)
            and torch.float32 in (*n.args[1:2], n.kwargs.get("dtype"))]


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "qwen2"])
def test_loss_reads_bf16_logits_bit_for_bit(family, monkeypatch):
    fam = FAMILIES[family]
    model = fam.build().to(torch.bfloat16)
    batch = make_batch(fam, seed=3)
    loss0, grads0, ce0 = run(model, batch, False, monkeypatch)
    loss1, grads1, ce1 = run(model, batch, True, monkeypatch)
    assert ce1[0].kwargs.get("out_dtype") is torch.float32 and "out_dtype" not in ce0[0].kwargs
    assert ce1[0].args[0].meta["val"].dtype is torch.bfloat16      # the loss reads the bf16 logits
    assert len(fp32_casts(ce1[0].graph.nodes)) < len(fp32_casts(ce0[0].graph.nodes))
    assert loss1.dtype is torch.float32 and torch.equal(loss0, loss1), (loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name


def test_fp32_model_is_left_alone(monkeypatch):
    fam = FAMILIES["llama"]
    _, _, ce = run(fam.build(), make_batch(fam, seed=3), True, monkeypatch)
    assert "out_dtype" not in ce[0].kwargs


def graph(extra_reader: bool, dtype=torch.bfloat16):
    """x -> to(float32) -> view -> vocab_parallel_cross_entropy, with meta values as the
    passes see them; ``extra_reader``: the fp32 copy is also an output."""
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    x.meta["val"] = torch.empty(2, 8, 64, dtype=dtype, device="meta")
    y.meta["val"] = torch.empty(16, dtype=torch.int64, device="meta")
    cast = g.call_function(aten.to.dtype, (x, torch.float32))
    cast.meta["val"] = torch.empty(2, 8, 64, device="meta")
    view = g.call_function(aten.view.default, (cast, [-1, 64]))
    view.meta["val"] = torch.empty(16, 64, device="meta")
    loss = g.call_function(vocab_parallel_cross_entropy, (view, y, 0, "0", 1, -100))
    g.output((loss, cast) if extra_reader else (loss,))
    return torch.fx.GraphModule(torch.nn.Module(), g), loss, view


def test_precondition_on_the_graph():
    gm, loss, view = graph(extra_reader=False)
    assert loss_reads_logits_dtype(gm) == 1
    assert loss.kwargs == {"out_dtype": torch.float32} and view.args[0].name == "x"
    assert view.meta["val"].dtype is torch.bfloat16
    for gm, loss, view in (graph(extra_reader=True), graph(False, torch.float32)):
        assert loss_reads_logits_dtype(gm) == 0       # the copy is read elsewhere / the cast is no upcast
        assert loss.kwargs == {} and view.args[0].target is aten.to.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_same_numbers_on_gpu(family, monkeypatch):
    """The compiled kernels: the loss within fp32 rounding (the kernel sums bf16 loads in
    another order than fp32 ones), the gradients within one bf16 rounding (the kernel rounds
    to nearest even, as torch's cast does; the interpreter truncates, so only a GPU shows it)."""
    fam = FAMILIES[family]
    model = fam.build().to(device="cuda", dtype=torch.bfloat16)
    batch = {k: v.cuda() for k, v in make_batch(fam, seed=3).items()}
    loss0, grads0, _ = run(model, batch, False, monkeypatch)
    loss1, grads1, ce = run(model, batch, True, monkeypatch)
    assert ce[0].kwargs.get("out_dtype") is torch.float32
    assert abs(loss0.item() - loss1.item()) <= 1e-6 * abs(loss0.item())
    for name in grads0:
        assert torch.allclose(grads0[name].float(), grads1[name].float(), rtol=2 ** -7, atol=1e-6), name
