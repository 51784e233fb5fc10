"""Under ``compile=True``: the tanh GeLU as x·σ(2·√(2/π)·(x + 0.044715·x³)), in fp32 (or fp64).

The two are the same function: ½(1 + tanh z) = σ(2z). Inductor lowers ``aten.gelu`` (tanh)
and its backward through libdevice's ``tanh``, whose instructions, not memory, bound the
kernel: 0.193 ms for gpt1.3b's [16384, 8192] bf16 activation on an H200 and on an H100
alike, 2.7 TB/s of the H200's 4.8 (profile in docs/history/PERFORMANCE-2026-11-26.md). The sigmoid form is an
``exp`` and a division, and its derivative (σ·(1 − σ)) shares the σ. fxmegatron's generated
GeLU kernel prints tanh the same way (``codegen/triton_printer.py``).

The rewrite computes in fp32 and casts back once, as ``aten.gelu`` does inside its kernel, so
a bf16 model rounds once, where it did. It runs after ``fuse``: GeLUs that a fused group took
are not in the graph any more. Erf GeLU (``approximate="none"``) has no such identity and
stays.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fxmegatron.ops.gemm_epilogue import CUBIC, TWO_SQRT_2_OVER_PI
from fxmegatron.passes.node_meta import copy_source

aten = torch.ops.aten



def _tanh_gelu(n: fx.Node) -> bool:
    if n.op != "call_function" or n.target is not aten.gelu.default:
        return False
    approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
    v = n.meta.get("val")
    return approximate == "tanh" and isinstance(v, torch.Tensor) and v.is_floating_point()


def _call(graph: fx.Graph, like: fx.Node, target, args, kwargs=None) -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    node.meta["val"] = target(*vals, **(kwargs or {}))
    copy_source(node, like, also=("placements", "tp_rule"))
    return node


def gelu_tanh_through_sigmoid(gm: fx.GraphModule) -> int:
    """Rewrite each tanh GeLU of ``gm`` and of its recomputed regions; returns how many."""
    from fxmegatron.passes.recompute import rewrite_each_node
    return rewrite_each_node(gm, _through_sigmoid)


def _through_sigmoid(graph: fx.Graph, n: fx.Node) -> bool:
    if not _tanh_gelu(n):
        return False
    dtype = n.meta["val"].dtype
    call = functools.partial(_call, graph, n)
    with graph.inserting_before(n):
        x = call(aten._to_copy.default, (n.args[0],), {"dtype": torch.promote_types(dtype, torch.float32)})
        inner = call(aten.add.Tensor, (call(aten.mul.Tensor, (call(aten.mul.Tensor, (x, x)), CUBIC)),
                                       TWO_SQRT_2_OVER_PI))
        s = call(aten.sigmoid.default, (call(aten.mul.Tensor, (x, inner)),))
        y = call(aten._to_copy.default, (call(aten.mul.Tensor, (x, s)),), {"dtype": dtype})
    n.replace_all_uses_with(y)
    graph.erase_node(n)
    return True
