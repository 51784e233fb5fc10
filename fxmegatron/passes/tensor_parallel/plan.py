"""What planning produces (``TPPlan``, one ``Decision`` per matmul, embedding and loss)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Set, Tuple

import torch.fx as fx

from fxmegatron.passes.redistribute import Edge
from fxmegatron.placement import Placement


@dataclass
class Decision:
    kind: str          # column | row | replicated | vocab
    reason: str = ""


# tp's changes of placement, (forward, backward) rows of the redistribution table, in the
# order the rewrite inserts them (node names follow that order: the pinned plans depend on it)
G = ("P->R", "R->R")                    # Megatron's g: partial sums made whole
SCATTER = ("P->S", "S->R")              # sequence parallelism's g
GATHER_INTO_COLUMN = ("S->R", "P->S")   # sequence parallelism's f: a gather into a column matmul
GATHER = ("S->R", "R->S")               # a sequence shard gathered anywhere else
SPLIT = ("R->S", "S->R")                # a replicated value into the sequence-split region
F = ("R->R", "P->R")                    # Megatron's f
SLICE = ("R->S", "S->P")                # this rank's slice, no communication
CHANGES = (G, SCATTER, GATHER_INTO_COLUMN, GATHER, SPLIT, F, SLICE)


@dataclass
class TPPlan:
    tp: int
    node_plc: Dict[fx.Node, object] = field(default_factory=dict)
    decisions: Dict[fx.Node, Decision] = field(default_factory=dict)
    rules: Dict[fx.Node, str] = field(default_factory=dict)        # which rule placed each node
    param_plc: Dict[str, Placement] = field(default_factory=dict)
    replicated_params: Dict[str, str] = field(default_factory=dict)
    # every change of placement the rules asked for, one Edge per (change, value[, dim]), in the
    # order first asked (``add``; ``edges`` lists them by change, in that order within one)
    changes: Dict[tuple, Edge] = field(default_factory=dict)
    arg_rewrites: Dict[fx.Node, tuple] = field(default_factory=dict)
    # a whole key/value that each rank slices to the kv heads its query heads use:
    # (attention, arg index) -> (dim, (start, length) per rank, f before the slice)
    head_slices: Dict[Tuple[fx.Node, int], Tuple[int, Tuple[Tuple[int, int], ...], bool]] = \
        field(default_factory=dict)
    bias_after: Dict[fx.Node, fx.Node] = field(default_factory=dict)
    row_bias: Set[fx.Node] = field(default_factory=set)
    sequence_parallel: bool = False
    attempts: int = 0

    @staticmethod
    def _key(change, value, dim):
        # a slice is cut per dim; a gather, scatter or split keeps the dim it was first asked at
        return (change, value, dim) if change == SLICE else (change, value)

    def add(self, change: Tuple[str, str], value: fx.Node, consumer: fx.Node, dim: Optional[int] = None) -> None:
        """``consumer`` reads ``value`` through ``change`` (one of ``CHANGES``), along ``dim``."""
        key = self._key(change, value, dim)
        if key not in self.changes:
            self.changes[key] = Edge("tp", value, set(), change[0], change[1], dim)
        self.changes[key].consumers.add(consumer)

    def _edge(self, change, value, dim=None):
        return self.changes.get(self._key(change, value, dim))

    def sees(self, change: Tuple[str, str], value: fx.Node, consumer: fx.Node) -> bool:
        """Whether ``consumer`` reads ``value`` through ``change`` (not SLICE: it is cut per dim)."""
        e = self._edge(change, value)
        return e is not None and consumer in e.consumers

    def has(self, change: Tuple[str, str], value: fx.Node) -> bool:
        """Whether ``value`` goes through ``change`` anywhere (not SLICE)."""
        return self._edge(change, value) is not None

    def dim_of(self, change: Tuple[str, str], value: fx.Node) -> Optional[int]:
        e = self._edge(change, value)
        return None if e is None else e.dim

    def move(self, old: Tuple[str, str], new: Tuple[str, str], value: fx.Node, consumer: fx.Node) -> None:
        """``consumer`` reads ``value`` through ``new`` instead of ``old`` (same dim); the old
        edge stays, possibly without consumers (its rewrite skips it)."""
        e = self._edge(old, value)
        e.consumers.discard(consumer)
        self.add(new, value, consumer, e.dim)

    def edges(self) -> Iterator[Edge]:
        """Every planned change of placement, change by change in ``CHANGES`` order."""
        order = {c: i for i, c in enumerate(CHANGES)}
        yield from sorted(self.changes.values(), key=lambda e: order[(e.forward, e.backward)])
