"""``passes.tables_once``: under compile=True a table computed from no parameter through a
transcendental op (rotary cos and sin) is computed once behind ``fxmegatron::computed_once``:
which families have one, that the graph's values do not change, that inductor's backward then
evaluates no sine or cosine (and does without the pass), and the preconditions (a table that
depends on a parameter, or is too large, stays as it was)."""
import copy

import pytest
import torch
import torch.nn as nn

import fxmegatron
from fxmegatron.ops.computed_once import computed_once
from fxmegatron.passes import tables_once
from fxmegatron.passes.tables_once import compute_tables_once

from .families import FAMILIES, make_batch

ONCE = computed_once._opoverload


def _rank_graph(model, batch):
    pm = fxmegatron.parallelize(model, None, batch)
    return pm, copy.deepcopy(pm.graph_module)


def _wrapped(gm):
    return [n.args[0] for n in gm.graph.nodes if n.target is ONCE]


# rotary families: the cos and the sin; GPT-J reads sin/cos from a buffer (nothing computed),
# GPT-2 learns its positions (a parameter); Bloom's ALiBi bias comes from a pow of the slopes
@pytest.mark.parametrize("name,expect", [("llama", {"cos", "sin"}), ("gemma", {"cos", "sin"}),
                                         ("phi", {"cos", "sin"}), ("gpt_neox", {"cos", "sin"}),
                                         ("qwen3", {"cos", "sin"}), ("gptj", set()), ("gpt2", set()),
                                         ("bloom", {"pow"})])
def test_each_familys_tables_are_found_and_the_values_stay(name, expect):
    fam = FAMILIES[name]
    batch = make_batch(fam, seed=3)
    pm, gm = _rank_graph(fam.build(), batch)
    n = compute_tables_once(gm)
    tables = _wrapped(gm)
    assert n == len(tables)
    # each wrapped table comes from the op named (through casts and scalings)
    seen = set()
    for t in tables:
        stack, names = [t], set()
        while stack:
            x = stack.pop()
            names.add(str(getattr(x.target, "__name__", x.target)).split(".")[0])
            stack.extend(x.all_input_nodes)
        seen |= names & {"cos", "sin", "pow"}
    assert seen == expect, (name, seen)
    assert compute_tables_once(gm) == 0     # a wrapped table is not wrapped again


def test_the_wrapped_graph_trains_as_the_plain_one():
    fam = FAMILIES["llama"]
    batch = make_batch(fam, seed=5)
    plain = fxmegatron.parallelize(fam.build(), None, batch)
    wrapped = fxmegatron.parallelize(fam.build(), None, batch)
    assert compute_tables_once(wrapped.graph_module) == 2
    for pm in (plain, wrapped):
        pm.train_step(batch)
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


def _compiled_code(monkeypatch, off: bool):
    from torch._inductor.utils import run_and_get_code
    if off:
        from fxmegatron.lower import rank_passes
        monkeypatch.setattr(rank_passes, "compute_tables_once", lambda gm: 0)
    fam = FAMILIES["llama"]
    batch = make_batch(fam, seed=7)
    pm = fxmegatron.parallelize(fam.build(), None, batch, compile=True)
    loss, codes = run_and_get_code(lambda: pm.train_step(batch))
    return pm, loss, codes


def _sines(code: str) -> int:
    return sum(code.count(s) for s in ("cos(", "sin("))


def test_inductors_backward_evaluates_no_sine_and_the_forward_one_table(monkeypatch):
    torch._dynamo.reset()
    pm, _, codes = _compiled_code(monkeypatch, off=False)
    assert any(n.target is ONCE for n in pm.graph_module.graph.nodes)
    assert len(codes) == 2, "one forward and one backward graph"
    forward, backward = codes
    assert _sines(backward) == 0
    assert "computed_once" in forward
    # planted: without the pass, inductor recomputes the tables in the backward
    torch._dynamo.reset()
    _, _, codes = _compiled_code(monkeypatch, off=True)
    assert _sines(codes[1]) > 0


class _Table(nn.Module):
    """A table from a buffer (or from a parameter) through cos, read by a linear."""

    def __init__(self, learned: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        freq = torch.linspace(0.1, 1.0, 8)
        if learned:
            self.freq = nn.Parameter(freq)
        else:
            self.register_buffer("freq", freq)

    def forward(self, x, y):
        pos = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
        table = torch.cos(pos * self.freq)
        h = self.lin(x) * table + self.lin(x * table)
        return nn.functional.mse_loss(h, y)


@pytest.mark.parametrize("learned,limit,expect", [(False, tables_once.MAX_ELEMENTS, 1), (True, tables_once.MAX_ELEMENTS, 0),
                                                  (False, 16, 0)])
def test_a_table_of_a_parameter_or_too_large_stays(learned, limit, expect, monkeypatch):
    monkeypatch.setattr(tables_once, "MAX_ELEMENTS", limit)
    torch.manual_seed(0)
    batch = (torch.randn(2, 6, 8), torch.randn(2, 6, 8))
    pm, gm = _rank_graph(_Table(learned), batch)
    assert compute_tables_once(gm) == expect
    assert len(_wrapped(gm)) == expect
