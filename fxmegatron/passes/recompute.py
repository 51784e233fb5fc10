"""Activation recomputation as a graph transformation.

A *region* is a contiguous run of nodes whose activations are not kept for
backward: the region is outlined into a sub-GraphModule and called through
``torch.utils.checkpoint`` (reentrant form: it saves exactly the region's
inputs and restores the RNG state before recomputing, so dropout draws the same
masks). The policy lives here, in ``RecomputePolicy``:

* ``full``: each transformer block, found from the graph's repeated module
  structure (module paths ``<prefix>.<index>``), is a region;
* ``selective`` (Korthikanti et al. 2022): the attention core, i.e. the ops in
  ``SELECTIVE_OPS`` (softmax, attention-score matmuls, fused attention);
* a ``RecomputePolicy(ops=..., modules=...)`` selects by ATen op or by a regular
  expression over module paths.

Recomputed nodes carry ``meta["recompute"]``; the dump shows each region's body.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, FrozenSet, List, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fxmegatron.capture import module_path
from fxmegatron.passes.outline import outline
from fxmegatron.ops.context_parallel import cp_attention
from fxmegatron.ops.dropout import counter_dropout_attention

aten = torch.ops.aten

SELECTIVE_OPS = frozenset({aten.scaled_dot_product_attention, aten._softmax, aten.softmax,
                           aten._safe_softmax, counter_dropout_attention, cp_attention.overloadpacket})


@dataclass(frozen=True)
class RecomputePolicy:
    """Which nodes to recompute: whole blocks, ATen op packets, or module-path regexes."""

    blocks: bool = False
    ops: FrozenSet = frozenset()
    modules: Sequence[str] = field(default_factory=tuple)
    name: str = "custom"

    @staticmethod
    def of(mode) -> Optional["RecomputePolicy"]:
        if mode is None or mode == "none":
            return None
        if isinstance(mode, RecomputePolicy):
            return mode
        if mode == "full":
            return RecomputePolicy(blocks=True, name="full")
        if mode == "selective":
            return RecomputePolicy(ops=SELECTIVE_OPS, name="selective")
        raise ValueError(f"recompute={mode!r}: expected 'none', 'selective', 'full' or a RecomputePolicy")


def block_of(node: fx.Node) -> str:
    """The outermost module on the node's stack whose path ends in an index (a block)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        path = path.replace("L['self'].", "")
        if re.search(r"\.\d+$", path) or re.search(r"\[\d+\]$", path):
            return path
    return ""


class Recomputed(nn.Module):
    """Runs ``body`` without keeping its activations; recomputes it in backward."""

    def __init__(self, body: fx.GraphModule, label: str):
        super().__init__()
        self.body = body
        self.label = label

    def forward(self, *inputs):
        if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad
                                                  for t in inputs):
            return self.body(*inputs)
        return checkpoint(self.body, *inputs, use_reentrant=True, preserve_rng_state=True)


def rewrite_each_node(gm: fx.GraphModule, rewrite: Callable[[fx.Graph, fx.Node], bool]) -> int:
    """Call ``rewrite(graph, node)`` on every node of ``gm`` and of its recomputed regions'
    bodies (a rewrite of single nodes must reach the ops recomputation outlined); returns how
    many it rewrote. Each graph it changed is linted and recompiled."""
    done = 0
    for g in [m.body for m in gm.modules() if isinstance(m, Recomputed)] + [gm]:
        here = sum(bool(rewrite(g.graph, n)) for n in list(g.graph.nodes))
        if here:
            g.graph.lint()
            g.recompile()
        done += here
    return done


def _regions(gm: fx.GraphModule, policy: RecomputePolicy) -> List[List[fx.Node]]:
    def key(n):
        if n.op != "call_function":
            return None
        if policy.blocks:
            return block_of(n) or None
        pk = getattr(n.target, "overloadpacket", n.target)
        if pk in policy.ops:
            return "op:" + (block_of(n) or module_path(n))
        mod = module_path(n)
        for pat in policy.modules:
            if re.search(pat, mod):
                return "mod:" + pat + ":" + (block_of(n) or mod)
        return None

    regions, cur, cur_key = [], [], None
    for n in gm.graph.nodes:
        k = key(n)
        if k is not None and k == cur_key:
            cur.append(n)
            continue
        if cur:
            regions.append(cur)
        cur, cur_key = ([n], k) if k is not None else ([], None)
    if cur:
        regions.append(cur)
    # a region must produce a tensor that needs grad to be worth checkpointing
    return [r for r in regions if any(isinstance(n.meta.get("val"), torch.Tensor) for n in r)]


def _outline(gm: fx.GraphModule, region: List[fx.Node], index: int, label: str) -> None:
    for n in region:
        n.meta["recompute"] = label
    outline(gm, region, f"recompute_{index}", lambda body, i, o: Recomputed(body, label), {"recompute": label})


def apply_recompute(gm: fx.GraphModule, mode) -> fx.GraphModule:
    """Outline every region the policy selects into a recomputed submodule."""
    policy = RecomputePolicy.of(mode)
    if policy is None:
        return gm
    for i, region in enumerate(_regions(gm, policy)):
        _outline(gm, region, i, policy.name)
    gm.graph.lint()
    gm.recompile()
    return gm
