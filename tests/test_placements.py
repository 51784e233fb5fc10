"""The per-axis placement value (``fxmegatron.placement``): one vocabulary for every mesh axis.

Tensor and context parallelism place values in the same three, Replicate / Shard / Partial
(a sequence shard of context parallelism is ``Shard(d, seq_inner=i)``, a whole value whose
sequence is known ``Replicate(seq=(d, i))``: ``context_parallel.layout``), checked on every
placement the cp and tp planners give the nodes of three families. ``Placements`` is a layout
over the mesh: a placement per axis.
"""
from __future__ import annotations

import copy
import itertools

import pytest

from fxmegatron.capture import capture
from fxmegatron.passes.attention_rewrites import attention_rewrites
from fxmegatron.passes.context_parallel import plan_context_parallel
from fxmegatron.passes.context_parallel.layout import is_split, seq, seq_at, seq_of, seq_through_view
from fxmegatron.passes.tensor_parallel import plan_tensor_parallel
from fxmegatron.placement import (P, Partial, Placements, R, Replicate, Shard, join_layout, join_shards, layout_from_json,
                                  layout_to_json, take_layout, take_shard)
from tests.families import FAMILIES, make_batch


# ---- the value ------------------------------------------------------------------------------
def test_the_tensor_parallel_vocabulary_prints_as_before():
    assert (str(R), str(P), str(Shard(1)), str(Shard(-1, (4, 2, 2)))) == ("R", "P(sum)", "S(1)",
                                                                           "S(-1, blocks=[4, 2, 2])")
    assert R == Replicate() and P == Partial() and Shard(0) == Shard(0, None, None)


def test_placements_name_an_axis_only_where_it_is_cut_or_partial():
    lay = Placements.of(tp=Shard(-1), cp=Shard(1, seq_inner=1), dp=R)
    assert lay.axes == (("cp", Shard(1, seq_inner=1)), ("tp", Shard(-1)))
    assert lay.on("tp") == Shard(-1) and lay.on("dp") == R and lay.on("ep") == R
    assert lay.sharded() == ("cp", "tp")
    assert str(lay) == "cp:S(1, seq) tp:S(-1)"
    assert Placements.of(tp=R, cp=None) == Placements() and str(Placements()) == "R"
    assert lay.with_axis("tp", P) == Placements.of(cp=Shard(1, seq_inner=1), tp=P)
    assert lay.with_axis("cp", R) == Placements.of(tp=Shard(-1))


def test_a_sequence_shard_is_not_cut_as_a_contiguous_slice():
    import torch
    s = Shard(1, seq_inner=1)
    with pytest.raises(ValueError, match="cp_take"):
        take_shard(torch.zeros(2, 8), s, 0, 2)
    with pytest.raises(ValueError, match="verify.context"):
        join_shards([torch.zeros(2, 4)] * 2, s)


# ---- context parallelism's sequence placements ----------------------------------------------
@pytest.mark.parametrize("d,i,split", list(itertools.product(range(4), (1, 3, 16), (True, False))))
def test_a_sequence_placement_says_where_the_sequence_is(d, i, split):
    p = seq(d, i, split)
    assert p == (Shard(d, seq_inner=i) if split else Replicate(seq=(d, i)))
    assert seq_of(p) == (d, i) and is_split(p) == split
    assert seq_at(p, d + 2) == seq(d + 2, i, split)
    assert p != R       # a known sequence is part of the value


@pytest.mark.parametrize("p", [R, P, Shard(0), Shard(1, (2, 2)), (Shard(1, seq_inner=1), R)], ids=str)
def test_what_holds_no_sequence(p):
    assert seq_of(p) is None and not is_split(p)


def test_a_view_moves_the_sequence_or_cuts_it():
    # [B=2, S=8, H=4] -> [B·S, H]: the sequence is dim 0, inner 1; -> [B, S·H]: dim 1, inner 4
    assert seq_through_view((2, 8, 4), seq(1), (16, 4), 8) == seq(0, 1)
    assert seq_through_view((2, 8, 4), seq(1, split=False), (2, 32), 8) == seq(1, 4, split=False)
    assert seq_through_view((2, 8, 4), seq(1), (2, 2, 4, 4), 8) is None      # S cut into 2 x 4


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_every_planned_placement_is_of_the_one_vocabulary(name):
    fam = FAMILIES[name]
    cap = capture(fam.build(1), make_batch(fam, 0))
    gm = copy.deepcopy(cap.gm)
    attention_rewrites(gm)
    cp_plan = plan_context_parallel(gm, 2, cap.params.keys())
    kinds = set()
    for p in cp_plan.plc.values():
        for q in (p if isinstance(p, tuple) else (p,)):
            assert isinstance(q, (Replicate, Shard, Partial)), q
            assert not isinstance(q, Shard) or (q.seq_inner is not None and q.blocks is None), q
            kinds.add(type(q).__name__ + ("(seq)" if seq_of(q) else ""))
    assert {"Shard(seq)", "Replicate(seq)", "Replicate"} <= kinds, kinds
    tp_plan = plan_tensor_parallel(copy.deepcopy(cap.gm), 2, cap.params.keys(), True)
    for p in tp_plan.node_plc.values():     # tp's placements are the per-axis vocabulary as they are
        assert Placements.of(tp=p).on("tp") == (p if p is not None else R)


def test_a_cp_rule_decides_and_the_walk_records(monkeypatch):
    """cp's rules are pure: they see a ``View`` (reads only) and return an ``Outcome``; what the
    plan holds for a node is that outcome, and a note the rewrite does not know is refused."""
    import dataclasses

    import torch

    from fxmegatron.passes.context_parallel.propagate import View
    from fxmegatron.passes.context_parallel.registry import RULES, Outcome
    assert not {"plan", "set", "take", "sum_for", "record"} & set(dir(View))
    fam = FAMILIES["llama"]
    cap = capture(fam.build(1), make_batch(fam, 0))
    ce = torch.ops.aten.cross_entropy_loss
    seen = {}

    def spy(view, node, split):
        assert isinstance(view, View)
        seen[node] = out = real(view, node, split)
        return out
    real = RULES[ce]
    monkeypatch.setitem(RULES, ce, spy)
    gm = copy.deepcopy(cap.gm)
    attention_rewrites(gm)
    plan = plan_context_parallel(gm, 2, cap.params.keys())
    (node, out), = seen.items()
    assert isinstance(out, Outcome) and out.placement == P and out.note[0] == "mean_loss"
    assert plan.plc[node] == out.placement and plan.mean_losses[node] == out.note[1]
    assert {a for (a, c) in plan.takes if c is node} == {a for a, _ in out.takes}
    monkeypatch.setitem(RULES, ce, lambda view, node, split: dataclasses.replace(real(view, node, split),
                                                                                note=("bogus", None)))
    with pytest.raises(ValueError, match="cross_entropy_loss: a rule's note 'bogus'"):
        plan_context_parallel(copy.deepcopy(gm), 2, cap.params.keys())


def test_a_tp_rule_decides_and_the_walk_records(monkeypatch):
    """tp's rules are pure as cp's: a rule reads a ``View`` that never writes the walk's state and
    returns its ``Outcome``; the plan then holds that outcome (here the layer norm's reduce-scatter
    under sequence parallelism and the column matmul's weight claim), and a rule that returns
    anything else is refused."""
    import torch

    from fxmegatron.passes.tensor_parallel.plan import F, SCATTER
    from fxmegatron.passes.tensor_parallel.rules import RULES
    from fxmegatron.passes.tensor_parallel.view import Outcome, View
    fam = FAMILIES["gpt2"]
    cap = capture(fam.build(1), make_batch(fam, 0))
    aten = torch.ops.aten
    seen = {}

    def spy(real):
        def rule(view, node):
            assert isinstance(view, View)
            st = view._s
            before = (dict(st.plan.changes), dict(st.plc), dict(st.plan.param_plc), dict(st.plan.decisions))
            out = real(view, node)
            assert (dict(st.plan.changes), dict(st.plc), dict(st.plan.param_plc), dict(st.plan.decisions)) == before
            seen.setdefault(real.rule_name, {})[node] = out     # the last attempt's is kept
            return out
        rule.rule_name = real.rule_name
        return rule
    for op in (aten.layer_norm, aten.addmm):
        monkeypatch.setitem(RULES, op, spy(RULES[op]))
    plan = plan_tensor_parallel(copy.deepcopy(cap.gm), 2, cap.params.keys(), sequence_parallel=True)
    norms = [(n, o) for n, o in seen["norms.layer_norm"].items() if o.placement == Shard(1)]
    assert norms and all(isinstance(o, Outcome) for _, o in norms)
    for node, out in norms:
        assert plan.node_plc[node] == out.placement
        for change, value, consumer, dim in out.changes:
            assert plan.sees(change, value, consumer) or change == F
        assert any(c == SCATTER for c, *_ in out.changes) or not any(
            isinstance(plan.node_plc.get(a), Partial) for a in node.all_input_nodes)
    columns = [(n, o) for n, o in seen["matmul"].items() if o.rule == "matmul.column"]
    assert columns
    for node, out in columns:
        for pname, (plc, _) in out.claims.items():
            assert plan.param_plc[pname] == plc
    def forgets_to_answer(view, node):
        view.set(node, Shard(1))
    forgets_to_answer.rule_name = "norms.layer_norm"
    monkeypatch.setitem(RULES, aten.layer_norm, forgets_to_answer)
    with pytest.raises(RuntimeError, match="returned None for node .*layer_norm"):
        plan_tensor_parallel(copy.deepcopy(cap.gm), 2, cap.params.keys(), sequence_parallel=True)


# ---- reassembly reads the per-axis placement -------------------------------------------------
def test_take_layout_cuts_over_the_axes_that_shard():
    import torch
    full = torch.arange(48.0).reshape(4, 12)
    qkv = Shard(1, (4, 4, 4))
    for world in (1, 2, 4):
        pieces = [take_layout(full, Placements.of(tp=qkv), {"tp": (r, world), "dp": (0, 2)}) for r in range(world)]
        assert torch.equal(join_shards(pieces, qkv), full)
        assert all(torch.equal(p, take_shard(full, qkv, r, world)) for r, p in enumerate(pieces))
    assert take_layout(full, Placements(), {"tp": (1, 2)}) is full
    assert take_layout(full, Placements.of(tp=Shard(0)), {}) is full     # an axis not in the mesh cuts nothing


@pytest.mark.parametrize("layout", [Placements.of(tp=Shard(1, (8, 8, 8))),
                                    Placements.of(ep=Shard(0), tp=Shard(1, (8, 8, 8))),
                                    Placements.of(ep=Shard(1), tp=Shard(1)), Placements()],
                         ids=["tp-blocks", "ep-rows-tp-blocks", "ep-and-tp-one-dim", "replicated"])
def test_join_layout_puts_back_what_take_layout_cut_over_every_axis(layout):
    """The checkpoint's reassembly: pieces keyed by the coordinates on the cutting axes, in the
    layout's axis order, joined back to the whole tensor at every degree."""
    import torch
    full = torch.arange(4 * 24.0).reshape(4, 24)
    for degrees in ({"ep": 1, "tp": 2}, {"ep": 2, "tp": 2}, {"ep": 4, "tp": 1}, {"ep": 2, "tp": 4}):
        if layout.on("ep") == Shard(1) and 24 % (degrees["ep"] * degrees["tp"]):
            continue
        axes = layout.sharded()
        pieces = {at: take_layout(full, layout, {a: (r, degrees[a]) for a, r in zip(axes, at)})
                  for at in itertools.product(*(range(degrees[a]) for a in axes))}
        assert torch.equal(join_layout(pieces, layout, degrees), full), (layout, degrees)
    assert layout_from_json(layout_to_json(layout)) == layout


def test_gather_layout_on_axes_of_one_copies_and_refuses_a_partial():
    import torch
    from fxmegatron.mesh import Axis
    from fxmegatron.runtime.gather import gather_layout
    x = torch.ones(2, 3)
    axes = {"tp": Axis(), "cp": Axis()}
    for lay in (Placements(), Placements.of(tp=Shard(1))):
        y = gather_layout(x, lay, axes)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    with pytest.raises(ValueError, match="partial"):
        gather_layout(x, Placements.of(tp=P), axes)


def test_a_programs_parameter_layout_is_its_tp_placement():
    from fxmegatron.program import RankProgram
    prog = RankProgram.__new__(RankProgram)          # the two fields param_layout reads
    object.__setattr__(prog, "placements", {"w": Shard(0), "b": R})
    object.__setattr__(prog, "aliases", {"tied": "w"})
    assert prog.param_layout("w") == prog.param_layout("tied") == Placements.of(tp=Shard(0))
    assert prog.param_layout("b") == prog.param_layout("missing") == Placements()
    # expert parallelism: an expert weight's experts dim over ep as well
    from fxmegatron.mesh import Axis
    object.__setattr__(prog, "experts", {"w": 0, "e": 0})
    object.__setattr__(prog, "axes", {"ep": Axis(2, 1, "", (0, 1))})
    assert prog.param_layout("w") == Placements.of(tp=Shard(0), ep=Shard(0))
    assert prog.param_layout("e") == Placements.of(ep=Shard(0)) and prog.param_layout("b") == Placements()


def test_nodes_carry_one_placement_per_axis_under_cp_and_tp():
    """After cp2 x tp2 (+sp) every node the passes placed holds meta["placements"]: a
    placement per axis, the tp and cp passes writing to the same record; a node sharded on
    both axes has a layout naming both, and the dump's cp column is cp's own words."""
    import copy
    import dataclasses

    from fxmegatron.capture import capture
    from fxmegatron.compiler import compile_captured
    from fxmegatron.config import ParallelConfig
    from fxmegatron.io.dump import placement_table
    from fxmegatron.mesh import Axis
    from fxmegatron.placement import node_layout, placed
    from tests.families import FAMILIES, make_batch

    fam = FAMILIES["llama"]
    cap = capture(fam.build(), make_batch(fam, 0))
    axes = {d: Axis() for d in ("dp", "pp", "tp", "cp")}
    axes.update({d: Axis(2, 0, f"job-{d}", (0, 1)) for d in ("tp", "cp")})
    prog = compile_captured(dataclasses.replace(cap, gm=copy.deepcopy(cap.gm)), axes, "meta",
                            ParallelConfig(sequence_parallel=True))
    nodes = list(prog.graph_module.graph.nodes)
    both = [n for n in nodes if placed(n, "tp") is not None and placed(n, "cp") is not None]
    assert both, "no node placed on both axes"
    layouts = [node_layout(n) for n in both]
    two_axes = [lay for lay in layouts if lay is not None and {"tp", "cp"} <= set(lay.sharded())]
    assert two_axes, [str(lay) for lay in layouts][:10]      # sequence shards on cp and sp shards on tp
    assert str(two_axes[0]).startswith("cp:S(1, seq) tp:S(")
    assert "S(1, seq)" in placement_table(prog.graph_module)
