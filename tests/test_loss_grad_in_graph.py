"""``grad_in_graph``: the fused cross-entropy's backward stated as torch ops (kernels/
cross_entropy.py ``_grad_ops``), used where inductor's overlap scheduler wraps nodes in
``control_deps`` and the in-place kernel cannot be compiled. The ops are the kernel's formula;
compiled, inductor fuses them into one kernel that writes over the donated logits."""
import re

import pytest
import torch

from fxmegatron.kernels.cross_entropy import _grad_ops, vocab_ce, vocab_ce_backward
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.loss_grad_in_place import loss_grad_in_graph

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _inputs(dtype, n=6, v=2100, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[1] = -1                                   # another rank's class: no one-hot
    lse = torch.logsumexp(logits.float(), 1)
    grad = torch.rand(n, generator=g)
    grad[2] = 0.0                               # an ignored row
    return logits, t, lse, grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 0)])
def test_the_ops_are_the_kernel(dtype, tol):
    logits, t, lse, grad = _inputs(dtype)
    want, got = vocab_ce_backward(logits, t, lse, grad), _grad_ops(logits, t, lse, grad)
    assert got.dtype == want.dtype
    # bf16: both round the same fp32 value; 1 ulp where the two exps differ in the last bit
    torch.testing.assert_close(got.float(), want.float(), rtol=tol or 8e-3, atol=tol or 1e-6)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def _loss(x, w, t, valid, in_graph):
    loss, _ = vocab_ce(x @ w, t, valid, "", False, in_graph)
    return loss.sum()


@pytest.mark.parametrize("in_graph", [True, pytest.param(False, marks=pytest.mark.xfail(strict=True))])
def test_compiled_the_gradient_is_the_kernels_and_written_over_the_logits(in_graph):
    """Compiled with the ops, the gradients are the eager kernel's, and the backward's fused
    kernel takes the saved logits' own buffer for its output (inductor's "bufN = mm; del mm  #
    reuse" line, the buffer then handed to the kernel whose name says exp). The opaque kernel
    (``in_graph`` False) makes a new tensor: it must fail the second check."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 256, requires_grad=True)
    t = torch.randint(0, 256, (8,))
    valid = torch.ones(8, dtype=torch.bool)
    valid[3] = False
    _loss(x, w, t, valid, False).backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: _loss(*a, in_graph))

    def step():
        fn(x, w, t, valid).backward()
    _, codes = run_and_get_code(step)
    torch.testing.assert_close(x.grad, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-5, atol=1e-6)
    backward = codes[-1][codes[-1].find("def call("):]
    reused = re.search(r"(buf\d+) = (mm\w*); del \2  # reuse", backward)
    assert reused and re.search(rf"_exp_\w*\({reused.group(1)}\b", backward), backward[:3000]


def test_the_pass_marks_every_loss_and_not_the_kernels_in_place_form():
    g = torch.fx.Graph()
    logits, target = g.placeholder("logits"), g.placeholder("target")
    loss = g.call_function(vocab_parallel_cross_entropy, (logits, target, 0, ""), {"reuse_logits": True})
    g.output(loss)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert loss_grad_in_graph(gm) == 1
    assert loss.kwargs == {"reuse_logits": False, "grad_in_graph": True}
    assert loss_grad_in_graph(gm) == 0


@pytest.mark.parametrize("family,kw", [("llama", {}), ("gpt2", {}), ("qwen2", {"microbatches": 2})])
def test_a_compiled_model_with_the_gradient_in_graph_is_the_kernels(family, kw, monkeypatch):
    """A whole program (fp32, compile=True; HF Llama, GPT-2 with its tied embedding, Qwen2 split
    into two microbatches, the first with no counted label) built as under the scheduler's
    wrappers (``rank_passes.schedules_collectives`` answered True; on CPU the scheduler itself
    does not run): the loss node asks for the graph form, and the step's loss and every gradient
    are the kernel form's."""
    import copy

    import fxmegatron
    import fxmegatron.lower.rank_passes as rank_passes
    from tests.families import FAMILIES, make_batch
    fam = FAMILIES[family]
    model = fam.build()
    batch = make_batch(fam, seed=5, batch_size=4)
    batch["labels"][0, :3] = -100
    if kw.get("microbatches"):
        batch["labels"][:2] = -100      # the first microbatch counts nothing
    runs = []
    for wrapped in (False, True):
        with monkeypatch.context() as mp:
            mp.setattr(rank_passes, "schedules_collectives", lambda *a: wrapped)
            mp.setattr(rank_passes, "scheduler_wraps_nodes", lambda: wrapped)
            pm = fxmegatron.parallelize(copy.deepcopy(model), None, batch, compile=True, **kw)
        ce = [n for n in pm.graph_module.graph.nodes if n.target is vocab_parallel_cross_entropy]
        assert [bool(n.kwargs.get("grad_in_graph")) for n in ce] == [wrapped]
        loss = pm.train_step(batch)
        runs.append((loss, {n: p.grad for n, p in pm.named_parameters()}))
    (l0, g0), (l1, g1) = runs
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
