"""What planning produces (``TPPlan``, one ``Decision`` per matmul, embedding and loss),
and the signal a rule raises when it learnt a constraint (``Restart``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, Set, Tuple

import torch.fx as fx

from fxmegatron.passes.redistribute import Edge
from fxmegatron.placement import Placement


class Restart(Exception):
    """Propagation learnt a constraint (demotion, forced replica, blocks); start over."""


@dataclass
class Decision:
    kind: str          # column | row | replicated | vocab
    reason: str = ""


# every kind of edge of a plan is one row of the redistribution table, in the order the
# rewrite inserts them (node names follow that order: the pinned plans depend on it)
EDGE_KINDS = (("g_edges", "P->R", "R->R"), ("scatter_edges", "P->S", "S->R"), ("gather_edges", "S->R", "P->S"),
              ("gather_full_edges", "S->R", "R->S"), ("split_edges", "R->S", "S->R"), ("f_edges", "R->R", "P->R"),
              ("slice_edges", "R->S", "S->P"))


@dataclass
class TPPlan:
    tp: int
    node_plc: Dict[fx.Node, object] = field(default_factory=dict)
    decisions: Dict[fx.Node, Decision] = field(default_factory=dict)
    rules: Dict[fx.Node, str] = field(default_factory=dict)        # which rule placed each node
    param_plc: Dict[str, Placement] = field(default_factory=dict)
    replicated_params: Dict[str, str] = field(default_factory=dict)
    g_edges: Dict[fx.Node, Set[fx.Node]] = field(default_factory=dict)
    f_edges: Dict[fx.Node, Set[fx.Node]] = field(default_factory=dict)
    slice_edges: Dict[Tuple[fx.Node, int], Set[fx.Node]] = field(default_factory=dict)
    arg_rewrites: Dict[fx.Node, tuple] = field(default_factory=dict)
    scatter_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)
    gather_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)       # into column matmuls
    gather_full_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)  # anywhere else
    split_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)
    # a whole key/value that each rank slices to the kv heads its query heads use:
    # (attention, arg index) -> (dim, (start, length) per rank, f before the slice)
    head_slices: Dict[Tuple[fx.Node, int], Tuple[int, Tuple[Tuple[int, int], ...], bool]] = \
        field(default_factory=dict)
    bias_after: Dict[fx.Node, fx.Node] = field(default_factory=dict)
    row_bias: Set[fx.Node] = field(default_factory=set)
    sequence_parallel: bool = False
    attempts: int = 0

    def edges(self) -> Iterator[Edge]:
        """Every planned change of placement, kind by kind in ``EDGE_KINDS`` order."""
        for kind, forward, backward in EDGE_KINDS:
            for key, v in getattr(self, kind).items():
                if kind == "slice_edges":
                    (src, dim), users = key, v
                elif kind in ("g_edges", "f_edges"):
                    src, dim, users = key, None, v
                else:
                    src, (dim, users) = key, v
                yield Edge("tp", src, users, forward, backward, dim)
