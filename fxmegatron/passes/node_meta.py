"""What a node a pass adds inherits from the node it stands for: where it came from.

The dump and every error name a node's source line (``stack_trace``) and module path
(``nn_module_stack``); a node that replaces or serves another reports that one's. Passes after
tensor parallelism may also carry its placement and rule (``placement``, ``tp_rule``). And
whether a node reads a parameter of the module (``is_parameter``), which several passes ask.
"""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx
import torch.nn as nn

SOURCE = ("stack_trace", "nn_module_stack")


def copy_source(n: fx.Node, like: fx.Node, also: Iterable[str] = ()) -> None:
    """``n`` reports ``like``'s source line and module path (and the ``also`` meta keys)."""
    for key in (*SOURCE, *also):
        if key in like.meta:
            n.meta[key] = like.meta[key]


def is_parameter(gm: fx.GraphModule, n) -> bool:
    """Whether ``n`` is a ``get_attr`` of one of ``gm``'s parameters (not a buffer)."""
    if not (isinstance(n, fx.Node) and n.op == "get_attr"):
        return False
    try:
        return isinstance(gm.get_parameter(n.target), nn.Parameter)
    except AttributeError:
        return False
