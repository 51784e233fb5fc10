"""``compile=True`` on a GPU against the same program uncompiled, fp32: the kernels fxmegatron
calls from inside inductor's graphs meet inductor's own buffer layouts there, which the CPU
tests never see (padded matmuls, donated buffers). With a vocabulary of 2053 (not a multiple
of 128 bytes, as GPT-2's 50257 is not) the compiled gradients were wrong on an H100
(``passes/compile_guards.py``), so such a program is refused; 2048 is compiled."""
import copy

import pytest
import torch

import fxmegatron
from tests.families import FAMILIES, make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(pm, batch):
    for p in pm.parameters():
        p.grad = None
    loss = pm(batch)
    loss.backward()
    return loss.item(), pm.full_grads()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_on_cuda_is_the_uncompiled_program(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fam = FAMILIES[family]
    model = fam.build(vocab_size=2048).cuda()
    cuda = lambda b: {k: v.cuda() for k, v in b.items()}     # noqa: E731
    plain = fxmegatron.parallelize(copy.deepcopy(model), None, cuda(make_batch(fam, 0)))
    compiled = fxmegatron.parallelize(copy.deepcopy(model), None, cuda(make_batch(fam, 0)), compile=True)
    for seed in (1, 2):
        b = cuda(make_batch(fam, seed))
        b["labels"][0, :3] = -100
        (l0, g0), (l1, g1) = _step(plain, b), _step(compiled, b)
        assert abs(l1 - l0) <= 1e-5 * abs(l0), (l1, l0)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{family} {k}: {m}")


def test_an_unaligned_vocabulary_is_refused_compiled_on_cuda():
    fam = FAMILIES["gpt2"]
    model = fam.build(vocab_size=2053).cuda()
    batch = {k: v.cuda() for k, v in make_batch(fam, 0).items()}
    with pytest.raises(fxmegatron.errors.CompileError, match="multiple of 32"):
        fxmegatron.parallelize(model, None, batch, compile=True)


def test_an_unaligned_vocabulary_compiled_with_the_rule_lifted(monkeypatch):
    """The check that lets ``passes/compile_guards.py`` go: with the refusal lifted, a vocabulary
    of 2053 compiled gives the uncompiled gradients (the in-place loss backward kept out, as
    ``passes/loss_grad_in_place.py`` now does for unaligned rows)."""
    import fxmegatron.compiler
    monkeypatch.setattr(fxmegatron.compiler, "refuse_known_miscompiles", lambda gm, tp=1: 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fam = FAMILIES["gpt2"]
    model = fam.build(vocab_size=2053).cuda()
    cuda = lambda b: {k: v.cuda() for k, v in b.items()}     # noqa: E731
    plain = fxmegatron.parallelize(copy.deepcopy(model), None, cuda(make_batch(fam, 0)))
    compiled = fxmegatron.parallelize(copy.deepcopy(model), None, cuda(make_batch(fam, 0)), compile=True)
    b = cuda(make_batch(fam, 1))
    (l0, g0), (l1, g1) = _step(plain, b), _step(compiled, b)
    assert abs(l1 - l0) <= 1e-5 * abs(l0), (l1, l0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
