"""``passes.merge_linears``: under compile=True sibling linears that read one input, one of them
at most half as wide as the widest (grouped-query attention's q, k and v), become one GEMM over
their concatenated weights. Which families have such a group, that the merged graph trains as
the plain one (several steps on different batches with masked labels, biases included), that
compile=True merges and still trains as the unmodified model (one process, and tp=2 with
sequence parallelism over gloo), that no member's reader keeps the merged output alive, and the
preconditions (equal widths, other parents, mixed biases, a computed weight, other inputs)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmegatron
from fxmegatron.capture import module_path
from fxmegatron.passes.merge_linears import merge_linears
from tests import models
from tests.distributed import run_distributed
from tests.workers import tp_parity

from .families import FAMILIES, make_batch

aten = torch.ops.aten


def _groups(gm):
    return [n.meta["merged_linears"] for n in gm.graph.nodes if "merged_linears" in n.meta]


def _rank_graph(model, batch):
    return fxmegatron.parallelize(model, None, batch)


QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


# grouped-query families merge q, k, v in every layer; GPT-2, GPT-NeoX, Bloom and Falcon already
# project q, k and v as one linear; GPT-J's and Phi's heads are all as wide (no narrow member)
@pytest.mark.parametrize("name,expect", [("llama", QKV), ("qwen2", QKV), ("qwen3", QKV), ("mixtral", QKV),
                                         ("gpt2", None), ("gpt_neox", None), ("bloom", None), ("falcon", None),
                                         ("gptj", None), ("phi", None)])
def test_which_families_merge(name, expect):
    fam = FAMILIES[name]
    pm = _rank_graph(fam.build(), make_batch(fam, seed=3))
    gm = copy.deepcopy(pm.graph_module)
    merge_linears(gm)
    groups = _groups(gm)
    layers = sum(1 for n in pm.graph_module.graph.nodes
                 if n.target is aten.linear.default and module_path(n).endswith("q_proj"))
    if expect is None:
        assert groups == []
        return
    assert len(groups) == layers > 0
    for i, g in enumerate(groups):
        assert [p.split(f"layers.{i}.")[-1] for p in g] == expect, g
    assert merge_linears(gm) == 0       # merged linears are not merged again


def test_equal_widths_merge_only_when_asked():
    fam = FAMILIES["gptj"]
    pm = _rank_graph(fam.build(), make_batch(fam, seed=3))
    assert merge_linears(copy.deepcopy(pm.graph_module)) == 0
    assert merge_linears(copy.deepcopy(pm.graph_module), widths="all") > 0
    with pytest.raises(ValueError, match="widths='some'"):
        merge_linears(pm.graph_module, widths="some")


def _train(pm, fam, steps=3, lr=0.05):
    """Losses and first-step gradients of ``steps`` SGD steps on different masked batches."""
    losses, grads = [], None
    for s in range(steps):
        losses.append(pm.train_step(make_batch(fam, seed=10 + s)).item())
        if grads is None:
            grads = {k: p.grad.clone() for k, p in pm.named_parameters()}
        with torch.no_grad():
            for p in pm.parameters():
                p -= lr * p.grad
                p.grad = None
    return losses, grads


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_merged_graph_trains_as_the_plain_one(name):
    fam = FAMILIES[name]
    batch = make_batch(fam, seed=3)
    plain = _rank_graph(fam.build(), batch)
    merged = _rank_graph(fam.build(), batch)
    assert merge_linears(merged.graph_module) > 0
    (l0, g0), (l1, g1) = _train(plain, fam), _train(merged, fam)
    assert l1 == pytest.approx(l0, rel=1e-5)
    assert len(set(l0)) == len(l0)      # different batches, updated weights
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_merged_in_every_group_trains_as_the_plain_one_over_microbatches(name):
    """Every family, every group merged (``widths="all"``: the equal-width ones too, where the
    rule would keep them), two microbatches (a MoE family's router loss summed over them): the
    loss and every gradient of the plain graph."""
    fam = FAMILIES[name]
    batch = make_batch(fam, seed=4, batch_size=4)
    plain = fxmegatron.parallelize(fam.build(), None, batch, microbatches=2)
    merged = fxmegatron.parallelize(fam.build(), None, batch, microbatches=2)
    n = merge_linears(merged.graph_module, widths="all")
    l0, l1 = plain.train_step(batch).item(), merged.train_step(batch).item()
    assert l1 == pytest.approx(l0, rel=1e-5)
    for (k, a), (_, b) in zip(plain.named_parameters(), merged.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {k} ({n} groups)")


def test_no_reader_holds_the_merged_output():
    """Each member's readers read a copy of its columns: a view would keep the whole merged
    output alive wherever an opaque op saves its input (the attention kernel, v)."""
    fam = FAMILIES["llama"]
    pm = _rank_graph(fam.build(), make_batch(fam, seed=3))
    gm = pm.graph_module
    merge_linears(gm)
    merged = [n for n in gm.graph.nodes if "merged_linears" in n.meta]
    assert merged
    for m in merged:
        assert len(m.users) == 3 and all(u.target is aten.slice.Tensor for u in m.users)
        for s in m.users:
            assert [u.target for u in s.users] == [aten.clone.default]


def test_compile_merges_and_trains_as_the_unmodified_model():
    torch._dynamo.reset()
    fam = FAMILIES["qwen2"]
    model = fam.build()
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(model, None, make_batch(fam, seed=3), compile=True)
    assert len(_groups(pm.graph_module)) > 0
    opt, opt_ref = torch.optim.AdamW(pm.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for s in range(3):
        b = make_batch(fam, seed=20 + s)
        loss = pm.train_step(b)
        loss_ref = ref(**b).loss
        loss_ref.backward()
        assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
        if s == 0:
            for k, p in ref.named_parameters():
                torch.testing.assert_close(pm.full_grads()[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()


def test_tp2_sequence_parallel_compiled_merges_each_ranks_shards():
    torch._dynamo.reset()
    out = run_distributed(tp_parity, 2, ["llama"], 3, {"sequence_parallel": True, "compile": True})
    for r in out:
        got = r["llama"]
        assert len(got["merged_linears"]) == 2, got["merged_linears"]       # two layers
        assert got["losses"] == pytest.approx(got["losses_ref"], rel=1e-5)
        assert max(got["grad_err"].values()) < 1e-4, got["grad_err"]


class _Lin(nn.Linear):
    """A linear whose weight is a parameter, or computed from one (``computed``)."""

    def __init__(self, width, bias, computed):
        super().__init__(8, width, bias=bias)
        self.computed = computed

    def forward(self, x):
        return F.linear(x, self.weight * 1.5 if self.computed else self.weight, self.bias)


class _Siblings(nn.Module):
    """Linears over one input in one module (``a``), unless told otherwise; the second one's
    weight computed (``computed``) or its input another (``other_input``)."""

    def __init__(self, widths=(16, 4, 4), bias=(False, False, False), parents=("a", "a", "a"), computed=False,
                 other_input=False):
        super().__init__()
        self.a, self.b = nn.Module(), nn.Module()
        for i, (w, b, p) in enumerate(zip(widths, bias, parents)):
            setattr(getattr(self, p), f"l{i}", _Lin(w, b, computed and i == 1))
        self.spec = list(zip(range(len(widths)), parents))
        self.other_input = other_input

    def forward(self, x, y):
        outs = []
        for i, p in self.spec:
            inp = x * 2 if (self.other_input and i == 1) else x
            outs.append(getattr(getattr(self, p), f"l{i}")(inp).sum(-1))
        return F.mse_loss(sum(outs), y)


@pytest.mark.parametrize("kw,expect", [({}, 1), ({"widths": (16, 16)}, 0), ({"widths": (16, 8)}, 1),
                                       ({"parents": ("a", "b", "a")}, 1), ({"parents": ("a", "b", "b")}, 0),
                                       ({"widths": (4, 16, 4), "bias": (True, False, False)}, 1),
                                       ({"widths": (16, 4), "bias": (True, False)}, 0), ({"widths": (16, 4), "bias": (True, True)}, 1),
                                       ({"computed": True}, 1), ({"widths": (16, 4), "computed": True}, 0),
                                       ({"widths": (16, 4), "other_input": True}, 0)])
def test_preconditions(kw, expect):
    kw = dict(kw)
    n = len(kw.get("widths", (16, 4, 4)))
    kw.setdefault("bias", (False,) * n)
    kw.setdefault("parents", ("a",) * n)
    torch.manual_seed(0)
    model = _Siblings(**kw)
    batch = (torch.randn(2, 5, 8), torch.randn(2, 5))
    plain = _rank_graph(copy.deepcopy(model), batch)
    pm = _rank_graph(model, batch)
    assert merge_linears(pm.graph_module) == expect
    for a, b in ((plain, batch), (pm, batch)):
        a.train_step(b)
    for (k, p), (_, q) in zip(plain.named_parameters(), pm.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=k)
