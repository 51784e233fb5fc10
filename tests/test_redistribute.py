"""The redistribution table (``fxmegatron.passes.redistribute``): one row per (axis, forward
change, backward change) of placement, and the graph function that realises it.

What the rewrites of tp and cp insert through it is pinned by tests/test_same_plans.py and
tests/test_collectives_in_dump.py (the same collectives, byte for byte); here the table itself:
its rows agree with the ops' records (``ops.registry``) on what communicates, every
communicating backward is some row's forward, and a new axis is a row.
"""
from __future__ import annotations

import pytest
import torch

from fxmegatron.ops.collectives import all_gather_seq, copy_to_tp, gather_seq, reduce_from_tp, scatter_seq
from fxmegatron.ops.context_parallel import cp_sum, cp_take
from fxmegatron.ops.registry import record
from fxmegatron.passes import redistribute
from fxmegatron.passes.redistribute import TABLE, Site, find, kind, row
from fxmegatron.placement import P, Partial, R, Replicate, Shard


def test_the_table_holds_what_tp_and_cp_insert():
    assert find("tp", "R->R", "P->R").op is copy_to_tp
    assert find("tp", "P->R", "R->R").op is reduce_from_tp
    assert find("tp", "P->S", "S->R").op is scatter_seq
    assert find("tp", "S->R", "P->S").op is gather_seq
    assert find("tp", "S->R", "R->S").op is all_gather_seq
    assert find("cp", "R->S", "S->P").op is cp_take
    assert find("cp", "P->R", "R->R").op is cp_sum
    assert {k[0] for k in TABLE} == {"tp", "cp"}


@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: " ".join(k))
def test_a_row_communicates_exactly_where_its_op_has_a_record(key):
    r = TABLE[key]
    rec = record(r.op)
    args = r.args("x", Site(rank=0, world=2, group="g", dim=1, inner=1, seq=8))
    assert (rec is not None and rec.communicates(args)) == r.communicates, (key, rec)


@pytest.mark.parametrize("key", sorted(TABLE), ids=lambda k: " ".join(k))
def test_a_communicating_backward_is_a_forward_of_the_same_axis(key):
    axis, _, backward = key
    if backward in redistribute.COMMUNICATING:
        assert any(k[0] == axis and k[1] == backward for k in TABLE), key


def test_the_arguments_are_the_ops_signatures():
    s = Site(rank=1, world=2, group="grp", dim=-2, inner=3, seq=16)
    assert find("tp", "S->R", "R->S").args("x", s) == ("x", -2, 1, 2, "grp")
    assert find("tp", "P->S", "S->R").args("x", s) == ("x", -2, 2, "grp")
    assert find("cp", "R->S", "S->P").args("x", s) == ("x", -2, 3, 16, 2, 1)
    x = torch.arange(2 * 16 * 3.0).reshape(2, 48)     # [outer 2, S 16, inner 3] in dim 1
    got = cp_take(*find("cp", "R->S", "S->P").args(x, Site(1, 2, "", 1, 3, 16)))
    assert got.shape == (2, 24)                        # chunks 1 and 2 of 4, each 4 positions x 3
    assert got[0, :12].tolist() == x[0, 12:24].tolist() and got[0, 12:].tolist() == x[0, 24:36].tolist()


def test_a_change_the_table_lacks_is_named_with_what_it_has():
    with pytest.raises(KeyError, match=r"no redistribution on cp for S->R .*\('cp', 'P->R', 'R->R'\)"):
        find("cp", "S->R", "R->S")


def test_a_new_axis_is_rows():
    def all_to_all(x, dim, world, group):       # stand-in: not a real op
        return x
    try:
        r = row("ep", "S->S", "S->S", all_to_all, lambda x, s: (x, s.dim, s.world, s.group), "tokens to experts")
        assert find("ep", "S->S", "S->S") is r and r.communicates
        with pytest.raises(ValueError, match="stated already"):
            row("ep", "S->S", "S->S", all_to_all, r.args)
    finally:
        TABLE.pop(("ep", "S->S", "S->S"), None)


def test_one_rewrite_inserts_every_axis_rows_where_the_row_says():
    """``insert_edges`` on a toy graph with a new axis's rows: a cut before its first consumer, a
    sum after its value, and an R->R change of a value summed before starting from the sum."""
    import torch.fx as fx

    from fxmegatron.passes.redistribute import Edge, insert_edges

    def cut(x, dim, rank):      # stand-ins: not real ops
        return x

    def total(x, group):
        return x

    def mark(x, group):
        return x
    rows = [row("zz", "R->S", "S->P", cut, lambda x, s: (x, s.dim, s.rank), before_consumer=True),
            row("zz", "P->R", "R->R", total, lambda x, s: (x, s.group)),
            row("zz", "R->R", "P->R", mark, lambda x, s: (x, s.group))]
    try:
        g = fx.Graph()
        a, b = g.placeholder("a"), g.placeholder("b")
        partial = g.call_function(torch.neg, (b,))
        first = g.call_function(torch.add, (partial, a))
        second = g.call_function(torch.mul, (partial, a))
        g.output((first, second))
        seen = []

        def finish(e, src, anchor, new):
            seen.append((e.forward, src.name, anchor.name))
            return new
        insert_edges(g, [Edge("zz", a, [second], "R->S", "S->P", 1), Edge("zz", partial, [first, second], "P->R", "R->R"),
                         Edge("zz", partial, [second], "R->R", "P->R")], lambda e: Site(3, 4, "grp", e.dim), finish)
        order = [n.name for n in g.nodes]
        assert seen == [("R->S", "a", "mul"), ("P->R", "neg", "neg"), ("R->R", "total", "total")]
        assert order.index("cut") == order.index("mul") - 1                 # right before its consumer
        assert order.index("total") == order.index("neg") + 1               # right after its value
        assert second.args == (g.find_nodes(op="call_function", target=mark)[0], g.find_nodes(op="call_function", target=cut)[0])
        assert first.args[0].target is total and second.args[0].args[0].target is total   # the f reads the sum
        assert g.find_nodes(op="call_function", target=cut)[0].args == (a, 1, 3)
    finally:
        for r in rows:
            TABLE.pop((r.axis, r.forward, r.backward), None)


def test_kind_is_the_placement_letter():
    assert [kind(p) for p in (R, Replicate(seq=(1, 1)), Shard(0), Shard(1, seq_inner=1), P, Partial("max"))] == \
        ["R", "R", "S", "S", "P", "P"]
    with pytest.raises(ValueError):
        kind(None)


def test_every_kind_of_tp_edge_is_a_row_and_a_plan_lists_its_edges():
    import copy

    from fxmegatron.capture import capture
    from fxmegatron.passes.tensor_parallel import plan_tensor_parallel
    from fxmegatron.passes.tensor_parallel.plan import CHANGES
    from tests.families import FAMILIES, make_batch
    for forward, backward in CHANGES:
        find("tp", forward, backward)
    fam = FAMILIES["gpt2"]
    cap = capture(fam.build(1), make_batch(fam, 0))
    plan = plan_tensor_parallel(copy.deepcopy(cap.gm), 2, cap.params.keys(), True)
    edges = list(plan.edges())
    counts = {(e.forward, e.backward) for e in edges}
    assert {("R->R", "P->R"), ("P->S", "S->R"), ("S->R", "P->S")} <= counts, counts     # f, sp's g and f
    assert len(edges) == len(plan.changes)
    order = [CHANGES.index((e.forward, e.backward)) for e in edges]
    assert order == sorted(order)                    # change by change, as the rewrite inserts them
    assert all((e.dim is None) == (e.forward == "R->R" or e.forward == "P->R") for e in edges)


def test_a_cp_plan_lists_its_takes_and_sums_as_edges():
    import copy

    from fxmegatron.capture import capture
    from fxmegatron.passes.attention_rewrites import attention_rewrites
    from fxmegatron.passes.context_parallel import plan_context_parallel
    from tests.families import FAMILIES, make_batch
    fam = FAMILIES["llama"]
    cap = capture(fam.build(1), make_batch(fam, 0))
    gm = copy.deepcopy(cap.gm)
    attention_rewrites(gm)
    plan = plan_context_parallel(gm, 2, cap.params.keys())
    edges = list(plan.edges())
    takes = [e for e in edges if e.forward == "R->S"]
    sums = [e for e in edges if e.forward == "P->R"]
    assert takes and sums and edges == takes + sums            # takes first, as the rewrite inserts them
    assert all(e.axis == "cp" and find("cp", e.forward, e.backward) for e in edges)
    assert sum(len(e.consumers) for e in takes) == len(plan.takes)
    assert sum(len(e.consumers) for e in sums) == len(plan.sums)
    assert len({(e.value, e.dim, e.inner) for e in takes}) == len(takes)
    for e in sums:
        assert [c.name for c in e.consumers] == sorted(c.name for c in e.consumers)
