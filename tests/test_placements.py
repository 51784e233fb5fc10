"""The per-axis placement value (``fxmegatron.placement``): one vocabulary for every mesh axis.

Tensor parallelism's placements are already Replicate / Shard / Partial; context parallelism's
(``Seq`` / ``WHOLE`` / ``PARTIAL``) map onto the same three (``context_parallel.layout.
to_placement``) and back, a bijection: checked on every placement of every kind, and on every
placement the cp planner gives the nodes of three families. ``Placements`` is a layout over
the mesh: a placement per axis.
"""
from __future__ import annotations

import copy
import itertools

import pytest

from fxmegatron.capture import capture
from fxmegatron.passes.attention_rewrites import attention_rewrites
from fxmegatron.passes.context_parallel import plan_context_parallel
from fxmegatron.passes.context_parallel.layout import PARTIAL, WHOLE, Seq, from_placement, to_placement
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


# ---- context parallelism's vocabulary: a bijection -------------------------------------------
CP_PLACEMENTS = [WHOLE, PARTIAL] + [Seq(d, i, sp) for d, i, sp in itertools.product(range(4), (1, 3, 16),
                                                                                      (True, False))]


@pytest.mark.parametrize("p", CP_PLACEMENTS, ids=str)
def test_every_cp_placement_goes_and_comes_back(p):
    q = to_placement(p)
    assert from_placement(q) == p or from_placement(q) is p
    assert isinstance(q, (Replicate, Shard, Partial))


def test_the_cp_map_is_one_to_one_and_says_what_it_means():
    images = [to_placement(p) for p in CP_PLACEMENTS]
    assert len(set(images)) == len(images)
    assert to_placement(Seq(1)) == Shard(1, seq_inner=1)
    assert to_placement(Seq(0, 16)) == Shard(0, seq_inner=16)
    assert to_placement(Seq(2, 1, False)) == Replicate(seq=(2, 1))
    assert to_placement(WHOLE) == R and to_placement(PARTIAL) == P
    assert to_placement((Seq(1), WHOLE)) == (Shard(1, seq_inner=1), R)


@pytest.mark.parametrize("p", [Shard(0), Shard(1, (2, 2)), Partial("max"), Shard(1, (2, 2), seq_inner=1)], ids=str)
def test_what_cp_never_makes_is_refused(p):
    with pytest.raises(ValueError, match="context parallelism has no placement"):
        from_placement(p)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_every_planned_placement_round_trips(name):
    fam = FAMILIES[name]
    cap = capture(fam.build(1), make_batch(fam, 0))
    gm = copy.deepcopy(cap.gm)
    attention_rewrites(gm)
    cp_plan = plan_context_parallel(gm, 2, cap.params.keys())
    kinds = set()
    for p in cp_plan.plc.values():
        q = to_placement(p)
        assert from_placement(q) == p, (p, q)
        kinds.update(type(x).__name__ for x in (q if isinstance(q, tuple) else (q,)))
    assert {"Shard", "Replicate"} <= kinds
    tp_plan = plan_tensor_parallel(copy.deepcopy(cap.gm), 2, cap.params.keys(), True)
    for p in tp_plan.node_plc.values():     # tp's placements are the per-axis vocabulary as they are
        assert Placements.of(tp=p).on("tp") == (p if p is not None else R)


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
    assert "Seq(1)" in placement_table(prog.graph_module)
