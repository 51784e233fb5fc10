"""Fuse runs of elementwise ATen ops into one generated Triton kernel each.

A group is a run of elementwise nodes in graph order, each using a value of the
run, all producing the run's shape. Its tensor inputs are either of that shape
("full") or broadcast along the last dim ("row", a bias). Nodes outside the group
may sit between members as long as none of them uses a member, so every member
used later can be an output of the fused call placed at the run's last member.

Each group becomes a ``Fused`` submodule. On CUDA tensors (or under
``TRITON_INTERPRET=1``) it runs the generated forward kernel, and in backward a
kernel that recomputes the chain from the group's inputs. Elsewhere it runs the
original ATen ops, kept as a GraphModule. The dump writes each group's Triton source.
"""
from __future__ import annotations

import os
from typing import List

import torch
import torch.fx as fx
import torch.nn as nn

from ..codegen.expr import ELEMENTWISE, lower_nodes
from ..codegen.triton_kernel import FULL, ROW, FusedChain
from .outline import boundary, outline


class Fused(nn.Module):
    """One fused elementwise group: generated kernels, with the ATen ops as the fallback."""

    def __init__(self, fallback: fx.GraphModule, chain, kinds, label: str):
        super().__init__()
        self.fallback = fallback
        self.kinds = list(kinds)
        self.label = label
        self.kernel = FusedChain(chain, kinds)

    def forward(self, *xs):
        from torch._subclasses.fake_tensor import is_fake

        real = not is_fake(xs[0]) and xs[0].device.type != "meta"    # shape propagation runs the ops
        if real and (xs[0].is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            out = self.kernel.apply(*xs)
            return out if isinstance(out, tuple) else (out,)
        return self.fallback(*xs)

    def source(self) -> str:
        return f"# {self.label}\n# inputs: {self.kinds}\n\n{self.kernel.fwd_src}\n\n{self.kernel.bwd_src}"


def _pk(n):
    return getattr(n.target, "overloadpacket", None)


def _shape(n):
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _kind(inp: fx.Node, shape) -> str:
    s = _shape(inp)
    if s == shape:
        return FULL
    if s is not None and len(s) >= 1 and s[-1] == shape[-1] and all(d == 1 for d in s[:-1]):
        return ROW
    return ""


def _fusible(n: fx.Node) -> bool:
    if n.op != "call_function" or _pk(n) not in ELEMENTWISE:
        return False
    if set(n.kwargs) - {"alpha", "approximate"}:      # e.g. div's rounding_mode: not this kind of op
        return False
    if any(not isinstance(a, (fx.Node, int, float, str)) for a in n.args):
        return False
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1 and not v.is_complex()


def _groups(gm: fx.GraphModule) -> List[List[fx.Node]]:
    """Runs of connected elementwise nodes of one shape. Unrelated nodes may sit between
    members (SwiGLU's up-projection between silu and mul); a node that uses a member
    ends the run, since the fused call is placed at the run's last member."""
    groups, cur = [], []

    def close():
        if len(cur) >= 2:
            groups.append(list(cur))
        cur.clear()

    for n in gm.graph.nodes:
        members = set(cur)
        if _fusible(n) and cur:
            shape = _shape(cur[0])
            ins = n.all_input_nodes
            if (_shape(n) == shape and any(a in members for a in ins)
                    and all(a in members or _kind(a, shape) for a in ins)):
                cur.append(n)
                continue
        if cur and (any(a in members for a in n.all_input_nodes) or _fusible(n) or n.op == "output"):
            close()
        if _fusible(n) and all(_kind(a, _shape(n)) for a in n.all_input_nodes):
            cur.append(n)
    close()
    return groups


def _rewrite(gm: fx.GraphModule, group: List[fx.Node], index: int) -> None:
    shape = _shape(group[0])
    inputs, outputs = boundary(group)
    if not any(_kind(a, shape) == FULL for a in inputs):
        return      # the kernel's grid follows a full-shape input
    chain = lower_nodes(group, inputs, outputs)
    label = " -> ".join(str(_pk(n).__name__) for n in group)
    kinds = [_kind(a, shape) for a in inputs]
    outline(gm, group, f"fused_{index}", lambda body, i, o: Fused(body, chain, kinds, label), {"fused": label})


def apply_fuse(gm: fx.GraphModule) -> fx.GraphModule:
    """Fuse every elementwise run of ``gm`` and of its recomputed regions; in place."""
    from .recompute import Recomputed

    for mod in list(gm.modules()):
        if isinstance(mod, Recomputed):
            apply_fuse(mod.body)
    count = sum(1 for _ in gm.named_children() if _[0].startswith("fused_"))
    for i, group in enumerate(_groups(gm)):
        _rewrite(gm, group, count + i)
    gm.graph.lint()
    gm.recompile()
    return gm
