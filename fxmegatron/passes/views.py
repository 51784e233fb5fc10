"""Chains of view ops between a tensor's producer and its reader.

Several rewrites look through the reshapes that sit between two ops they pair (the matmul that
made the logits and the loss, a cast and the loss, an addmm and its GeLU): the ops here change
a tensor's shape and never its values (``reshape`` may copy a strided input; a rewrite that
writes through the chain then writes a copy no other op reads).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def is_view(n: fx.Node) -> bool:
    return n.target in VIEWS


def under_views(x, view: Callable[[fx.Node], bool] = is_view) -> Tuple[object, List[fx.Node]]:
    """(the node under a chain of ``view`` nodes, each read by the next alone, starting at ``x``;
    the chain, from ``x`` down). A view with another reader ends the chain, and is returned as
    the node under it."""
    chain = []
    while isinstance(x, fx.Node) and x.op == "call_function" and view(x) and len(x.users) == 1:
        chain.append(x)
        x = x.args[0]
    return x, chain
