"""Small readers of fx nodes that every placement rule uses."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.capture import module_path


def packet(node: fx.Node):
    """The op family of a call (``aten.mm`` for ``aten.mm.default``), or the target itself."""
    t = node.target
    return getattr(t, "overloadpacket", t)


def val(n):
    """The fake value traced for ``n`` (None for a non-node argument)."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def is_tensor_node(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(val(n), torch.Tensor)


def where(node: fx.Node) -> str:
    """How errors and reasons name a node: its name, op and module path."""
    mod = module_path(node)
    return f"node {node.name} ({packet(node)}){' in ' + mod if mod else ''}"


def norm(d: int, nd: int) -> int:
    """A dim counted from the front."""
    return d + nd if d < 0 else d


def arg(node: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` of a call, positional or by keyword."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
