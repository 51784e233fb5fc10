"""``compile=True`` on a GPU against the same program uncompiled, fp32: the kernels fxmegatron
calls from inside inductor's graphs meet inductor's own buffer layouts there, which the CPU
tests never see (padded matmuls, donated buffers). A vocabulary of 2053 (not a multiple of
128 bytes, as GPT-2's 50257 is not) is where inductor pads the LM head's matmul."""
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


def _same_gradients(family, vocab_size, seeds):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fam = FAMILIES[family]
    model = fam.build(vocab_size=vocab_size).cuda()
    cuda = lambda b: {k: v.cuda() for k, v in b.items()}     # noqa: E731
    plain = fxmegatron.parallelize(copy.deepcopy(model), None, cuda(make_batch(fam, 0)))
    compiled = fxmegatron.parallelize(copy.deepcopy(model), None, cuda(make_batch(fam, 0)), compile=True)
    for seed in seeds:
        b = cuda(make_batch(fam, seed))
        b["labels"][0, :3] = -100
        (l0, g0), (l1, g1) = _step(plain, b), _step(compiled, b)
        assert abs(l1 - l0) <= 1e-5 * abs(l0), (l1, l0)
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{family} {k}: {m}")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_on_cuda_is_the_uncompiled_program(family):
    _same_gradients(family, 2048, seeds=(1, 2))


def test_an_unaligned_vocabulary_compiled_is_the_uncompiled_program():
    """A vocabulary of 2053: inductor pads the LM head's matmul, and the loss keeps its
    out-of-place backward (``passes/loss_grad_in_place.py``). Before that rule the compiled
    gradients were wrong here on an H100 (42% of one gradient's elements)."""
    _same_gradients("gpt2", 2053, seeds=(1,))


def test_cuda_graphs_with_cudnn_attention_is_compile_true():
    """``compile="reduce-overhead"`` in bf16, where the attention's backward runs cuDNN on
    fxmegatron's own thread (``ops/own_thread.py``), with dq of the same number of elements as
    the MLP's weights (2·8·256·32 = 512·256), as in HF Llama-3.2-1B: inductor gives dq's dead
    buffer to a weight's gradient, and unless the thread's results are copied onto the caller's
    thread during the warm-up the graph tree refuses the step ("not allocated in pool"). Three steps: warm-up, recording,
    replay; each the compile=True step's loss and gradients (bf16 rounding)."""
    fam = FAMILIES["llama"]
    model = fam.build(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                      num_key_value_heads=4).cuda().to(torch.bfloat16)
    cuda = lambda b: {k: v.cuda() for k, v in b.items()}     # noqa: E731
    first = cuda(make_batch(fam, 0, seq=256))
    graphs = fxmegatron.parallelize(copy.deepcopy(model), None, first, compile="reduce-overhead")
    compiled = fxmegatron.parallelize(copy.deepcopy(model), None, first, compile=True)
    for seed in (1, 2, 3):
        b = cuda(make_batch(fam, seed, seq=256))
        (l0, g0), (l1, g1) = _step(compiled, b), _step(graphs, b)
        assert abs(l1 - l0) <= 1e-2 * abs(l0), (seed, l1, l0)
        for k in g0:
            torch.testing.assert_close(g1[k].float(), g0[k].float(), rtol=2e-2, atol=1e-3,
                                       msg=lambda m: f"step {seed} {k}: {m}")
        del g0, g1      # a graph's outputs are overwritten by its next replay
