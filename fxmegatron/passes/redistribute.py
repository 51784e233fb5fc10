"""One table: how a value's placement on one mesh axis changes, and the graph function that
realises the change.

A redistribution is named by the axis it runs over, its forward change of placement and the
backward change of the gradient (from the gradient's placement where the value arrives, to
the one where it left), each written ``"from->to"`` with placements by kind: ``R``
(Replicate), ``S`` (Shard, a sequence shard included) and ``P`` (Partial). Megatron's f is
``("tp", "R->R", "P->R")``: nothing forward, the gradient's partial sums reduced backward; g
is ``("tp", "P->R", "R->R")``. The backward change says which of two functions with the same
forward is meant: a sequence shard gathered into a column-parallel matmul gets a partial
gradient back (``gather_seq``, reduce-scatter backward), one gathered anywhere else a whole
one (``all_gather_seq``, a local slice backward).

Rows are stated once here, per axis kind; a planner names the change it needs and the
rewrite of its axis inserts ``row.op`` with ``row.args(x, site)``. A new axis (expert
parallelism's all-to-all, say) is new rows, not a new rewrite's choice of ops.
docs/ENGINE.md: where this stands in the one placement engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Dict, Iterable, NamedTuple, Optional, Tuple

from fxmegatron.ops.collectives import (all_gather_seq, copy_to_tp, gather_seq, local_shard, reduce_from_tp,
                                        scatter_seq, split_seq)
from fxmegatron.ops.context_parallel import cp_sum, cp_take
from fxmegatron.placement import Partial, Replicate, Shard

# the changes of placement that move data between ranks (the others are local: a slice, a
# zero-filled slot, nothing); S->S is a shard moved to another dim (an all-to-all)
COMMUNICATING = frozenset({"P->R", "P->S", "S->R", "S->S"})


@dataclass(frozen=True)
class Site:
    """Where a redistribution runs: this rank of the axis's ``world`` ranks, the group's name,
    the dim of the shard (its [outer, S, inner] layout and sequence length for cp's chunks)."""

    rank: int
    world: int
    group: str
    dim: Optional[int] = None
    inner: int = 1
    seq: int = 0


@dataclass(frozen=True)
class Redistribution:
    axis: str                                       # the mesh axis kind: "tp", "cp"
    forward: str                                    # "from->to" of the value's placement
    backward: str                                   # "from->to" of its gradient's
    op: Callable                                    # the graph function inserted
    args: Callable[[object, Site], tuple]           # (value node, site) -> the call's arguments
    note: str = ""
    # where the op goes: after the value (a collective, or a cut every consumer shares), or
    # before its first consumer (a cut of a graph input that the consumers' order places)
    before_consumer: bool = False

    @property
    def communicates(self) -> bool:
        """Whether the value or its gradient moves between ranks."""
        return self.forward in COMMUNICATING or self.backward in COMMUNICATING


class Edge(NamedTuple):
    """One planned change of placement: ``value`` as ``consumers`` read it, on ``axis``, by
    the table's row for (``forward``, ``backward``), along ``dim`` (None for f and g; with
    ``inner`` for cp's chunks). Plans list them (``TPPlan.edges``, ``CPPlan.edges``) in the
    order their rewrites insert them."""

    axis: str
    value: object                   # an fx.Node
    consumers: Collection           # fx.Nodes, in the order they are rewired
    forward: str
    backward: str
    dim: Optional[int] = None
    inner: int = 1


TABLE: Dict[Tuple[str, str, str], Redistribution] = {}


def row(axis: str, forward: str, backward: str, op: Callable, args: Callable[[object, Site], tuple],
        note: str = "", before_consumer: bool = False) -> Redistribution:
    """State one row (once per (axis, forward, backward))."""
    key = (axis, forward, backward)
    if key in TABLE:
        raise ValueError(f"{key}: stated already, by {TABLE[key].op.__name__}")
    TABLE[key] = r = Redistribution(axis, forward, backward, op, args, note, before_consumer)
    return r


def find(axis: str, forward: str, backward: str) -> Redistribution:
    """The row that realises ``forward`` (and ``backward`` for the gradient) on ``axis``."""
    r = TABLE.get((axis, forward, backward))
    if r is None:
        raise KeyError(f"no redistribution on {axis} for {forward} (gradient {backward}); the table has "
                       f"{sorted(k for k in TABLE if k[0] == axis)}")
    return r


def insert_edges(graph, edges: Iterable[Edge], site: Callable[[Edge], Site],
                 finish: Callable[[Edge, object, object, object], object]) -> None:
    """The one rewrite of every axis: for each edge, in order, the table's op for its change at
    the row's place (after the value, or before its first consumer), and its consumers rewired
    to it. ``site(edge)`` says where it runs; ``finish(edge, src, anchor, new)`` is the axis's
    (its metadata, its placement; tp adds a deferred bias there) and returns the node the
    consumers read. An R->R change of a value made whole earlier (tp's f after its g) starts
    from the whole node; an edge without consumers (tp's matmul rule moved them) is skipped."""
    whole = {}
    for e in edges:
        if not e.consumers:
            continue
        red = find(e.axis, e.forward, e.backward)
        src = whole.get(e.value, e.value) if e.forward == "R->R" else e.value
        anchor = next(iter(e.consumers)) if red.before_consumer else src
        with graph.inserting_before(anchor) if red.before_consumer else graph.inserting_after(anchor):
            new = graph.call_function(red.op, red.args(src, site(e)))
        new = finish(e, src, anchor, new)
        if e.forward == "P->R":
            whole[src] = new
        for consumer in e.consumers:
            consumer.replace_input_with(src, new)


def kind(plc) -> str:
    """A placement's letter: R, S or P."""
    if isinstance(plc, Shard):
        return "S"
    if isinstance(plc, Partial):
        return "P"
    if isinstance(plc, Replicate):
        return "R"
    raise ValueError(f"not a placement: {plc!r}")


# ---- tensor parallelism (Megatron's f and g, sequence parallelism's gathers and scatters) ----
row("tp", "R->R", "P->R", copy_to_tp, lambda x, s: (x, s.group),
    "f: a replicated value entering a split region")
row("tp", "P->R", "R->R", reduce_from_tp, lambda x, s: (x, s.group),
    "g: partial sums made whole")
row("tp", "P->S", "S->R", scatter_seq, lambda x, s: (x, s.dim, s.world, s.group),
    "sequence parallelism's g: partial sums reduce-scattered along the sequence")
row("tp", "S->R", "P->S", gather_seq, lambda x, s: (x, s.dim, s.world, s.group),
    "sequence parallelism's f: a sequence shard gathered into a column-parallel matmul")
row("tp", "S->R", "R->S", all_gather_seq, lambda x, s: (x, s.dim, s.rank, s.world, s.group),
    "a sequence shard gathered into a replicated region")
row("tp", "R->S", "S->R", split_seq, lambda x, s: (x, s.dim, s.rank, s.world, s.group),
    "a replicated value entering the sequence-split region")
row("tp", "R->S", "S->P", local_shard, lambda x, s: (x, s.dim, s.rank, s.world),
    "this rank's slice of a replicated value, no communication")

# ---- context parallelism ------------------------------------------------------------------
row("cp", "R->S", "S->P", cp_take, lambda x, s: (x, s.dim, s.inner, s.seq, s.world, s.rank),
    "this rank's load-balanced chunks of a whole value, no communication", before_consumer=True)
row("cp", "P->R", "R->R", cp_sum, lambda x, s: (x, s.group),
    "partial sums over the cp ranks made whole")
