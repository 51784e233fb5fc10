"""``passes/fp8_share.py``: every ``fp8_linear`` becomes ``fp8_quantize`` nodes and an
``fp8_linear_q``; linears that read one activation share its quantisation.

On the bundled GPT, HF Llama, GPT-2 (Conv1D) and Falcon (``x @ W.T``): q, k and v (and
gate and up) read one quantised copy of their input, every other operand has its own, and
the program computes the same bits as before the pass: loss and every gradient equal,
forward and backward, both recipes (the CPU emulation rounds exactly as the GPU path); and
the same bits on every HF family of tests/families.py.
"""
import copy
from collections import Counter

import pytest
import torch

from fxmegatron.capture import capture, module_path
from fxmegatron.ops.fp8 import fp8_linear
from fxmegatron.ops.fp8_operands import fp8_linear_q, quantize_operand
from fxmegatron.passes.fp8 import apply_fp8
from fxmegatron.passes.fp8_share import share_fp8_quantization
from fxmegatron.passes.runner import check_shapes
from tests.families import FAMILIES, make_batch
from tests.test_fp8_pass import FP8_COUNT, model_and_batch

aten = torch.ops.aten
# linears that read one activation, by the last part of their module path
SHARED = {"gpt": [{"q", "k", "v"}], "llama": [{"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}],
          "gpt2": [], "falcon": [{"query_key_value", "dense_h_to_4h"}]}     # Falcon: attention and MLP in parallel


def fp8_graph(name, recipe):
    model, batch = model_and_batch(name, seed=3)
    cap = capture(model, batch)
    apply_fp8(cap.gm, "all", recipe)
    return cap


def _source(n):
    """The node an fp8_quantize output was computed from (under its detach)."""
    q = n.args[0]
    assert q.target is quantize_operand and q.args[0].target is aten.detach.default
    return q, q.args[0].args[0]


def _input(n):
    """fp8_linear_q's x, under the reshape to [tokens, in]."""
    x = n.args[0]
    return x.args[0] if x.target is aten.reshape.default else x


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2", "falcon"])
def test_linears_reading_one_activation_share_its_quantisation(name):
    cap = fp8_graph(name, "rowwise")
    share_fp8_quantization(cap.gm)
    check_shapes(cap.gm)
    lins = [n for n in cap.gm.graph.nodes if n.target is fp8_linear_q]
    assert len(lins) == FP8_COUNT[name] and not any(n.target is fp8_linear for n in cap.gm.graph.nodes)
    quant = [n for n in cap.gm.graph.nodes if n.target is quantize_operand]
    xs = {_input(n) for n in lins}
    assert len(quant) == len(xs) + len(lins)             # one per distinct input, one per weight
    for n in lins:
        (qx, x), (qw, w) = _source(n.args[6]), _source(n.args[10])
        assert x is _input(n) and w is n.args[1] and qx is not qw
        assert n.args[0].meta["val"].dim() == 2 and n.meta["val"].dim() == 2
        assert all(a.args[0] is qx for a in n.args[6:10]) and all(a.args[0] is qw for a in n.args[10:14])
        assert [a.args[1] for a in n.args[6:14]] == [0, 1, 2, 3] * 2
    by_input = Counter(n.args[6].args[0] for n in lins)
    groups = sorted(sorted(module_path(n).rsplit(".", 1)[-1] for n in lins if n.args[6].args[0] is q)
                    for q, c in by_input.items() if c > 1)
    layers = len(groups) // max(len(SHARED[name]), 1)
    assert groups == sorted(sorted(s) for s in SHARED[name] for _ in range(layers)) \
        and (layers >= 2 or not SHARED[name])


def _run(gm, inputs):
    gm.zero_grad(set_to_none=True)
    loss = gm(*inputs)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in gm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,recipe", [("gpt", "tensorwise"), ("llama", "rowwise"), ("llama", "tensorwise"),
                                         ("gpt2", "rowwise"), ("falcon", "tensorwise")])
def test_the_shared_program_computes_the_same_bits(name, recipe):
    cap = fp8_graph(name, recipe)
    before = copy.deepcopy(cap.gm)
    share_fp8_quantization(cap.gm)
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in cap.example_inputs]
    loss0, grads0 = _run(before, inputs)
    loss1, grads1 = _run(cap.gm, inputs)
    assert torch.equal(loss0, loss1), (loss0, loss1)
    assert grads0.keys() == grads1.keys() and len(grads0) > FP8_COUNT[name]
    bad = [k for k in grads0 if not torch.equal(grads0[k], grads1[k])]
    assert not bad, bad


# Every HF family of tests/families.py (the rule was written from GPT, Llama, GPT-2 and Falcon),
# both recipes (under half a second a case)
SWEEP = [(name, recipe) for name in FAMILIES for recipe in ("tensorwise", "rowwise")]


@pytest.mark.parametrize("name,recipe", SWEEP)
def test_every_family_computes_the_same_bits_after_sharing(name, recipe):
    model, batch = FAMILIES[name].build(), make_batch(FAMILIES[name], 3)
    cap = capture(model, batch)
    apply_fp8(cap.gm, "all", recipe)
    before = copy.deepcopy(cap.gm)
    share_fp8_quantization(cap.gm)
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in cap.example_inputs]
    loss0, grads0 = _run(before, inputs)
    loss1, grads1 = _run(cap.gm, inputs)
    n_fp8 = sum(1 for n in cap.gm.graph.nodes if n.target is fp8_linear_q)
    assert n_fp8 > 0 and torch.equal(loss0, loss1), (name, n_fp8, loss0, loss1)
    bad = [k for k in grads0 if not torch.equal(grads0[k], grads1.get(k, torch.empty(0)))]
    assert grads0.keys() == grads1.keys() and not bad, (name, bad)
