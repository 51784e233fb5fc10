"""``lower.inductor_reinplace``: under compile=True the loss's backward writes the logits'
gradient over the donated logits themselves, with no copy of them first; and the pass leaves
alone what it cannot prove dead."""
import copy
import operator
import re

import pytest
import torch
import torch.fx as fx

import fxmegatron
from fxmegatron.lower.inductor_reinplace import copy_back_donated_logits

from . import models

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py, on a machine without CUDA)
pytestmark = pytest.mark.usefixtures("triton_interpreter")
_KERNELS_RUN = not torch.cuda.is_available()


def _backward_code(pm, name):
    from torch._inductor.utils import run_and_get_code

    def step():
        loss = pm(models.batch(name, seed=1))
        loss.backward()
        return loss
    _, codes = run_and_get_code(step)
    return [c for c in codes if "vocab_ce_backward_" in c]


def _logits_argument(code):
    """(the buffer the in-place loss backward writes into, the compiled graph's input names)"""
    inputs = set()
    for line in re.findall(r"^\s*(.+?) = args$", code, flags=re.M):
        inputs |= {s.strip() for s in line.split(",") if s.strip()}
    arg = re.search(r"vocab_ce_backward_\.default\((?:reinterpret_tensor\()?(\w+)", code).group(1)
    return arg, inputs


@pytest.mark.skipif(not _KERNELS_RUN, reason="the fused loss runs only on CUDA or in the interpreter")
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_compiled_loss_backward_writes_over_the_saved_logits(name):
    torch._dynamo.reset()
    model = models.build(name, n_layer=1)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name), compile=True)
    codes = _backward_code(pm, name)
    assert len(codes) == 1, len(codes)
    arg, inputs = _logits_argument(codes[0])
    # the logits as the backward graph received them, not a copy made first (`buf...`)
    assert arg in inputs, (arg, sorted(inputs))
    # and the numbers are the uncompiled program's
    plain = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name))
    for p in (pm, plain):
        for q in p.parameters():
            q.grad = None
        p(models.batch(name, seed=2)).backward()
    got, ref = pm.full_grads(), plain.full_grads()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6)


def _graph_with_loss_backward(base_is_input=True):
    import fxmegatron.kernels.cross_entropy  # noqa: F401  (registers the op)
    g = fx.Graph()
    logits, target, lse, grad = (g.placeholder(n) for n in ("logits", "target", "lse", "grad"))
    base = logits if base_is_input else g.call_function(torch.ops.aten.clone.default, (logits,))
    wrapped = g.call_function(
        torch.ops.higher_order.auto_functionalized_v2,
        (torch.ops.fxmegatron.vocab_ce_backward_.default,),
        {"local_target": target, "lse": lse, "g": grad, "_logits_base_index": 0, "_all_bases": [base]})
    new = g.call_function(operator.getitem, (wrapped, 1))
    g.output((new,))
    return g, base, new


def test_the_copy_back_goes_only_into_a_donated_input():
    g, base, new = _graph_with_loss_backward()
    assert copy_back_donated_logits(g, donated=[0]) == 1
    copies = [n for n in g.nodes if n.target is torch.ops.aten.copy_.default]
    assert [c.args for c in copies] == [(base, new)]
    # not donated: the caller may still read the logits, so no mutation of them
    for donated in ([], [1, 2, 3], None):
        g, _, _ = _graph_with_loss_backward()
        assert copy_back_donated_logits(g, donated=donated or []) == 0
    # the logits are not an input at all (the graph's own tensor): nothing to copy back to
    g, _, _ = _graph_with_loss_backward(base_is_input=False)
    assert copy_back_donated_logits(g, donated=[0]) == 0
