"""Under ``compile=True`` on CUDA: a linear whose only reader is a tanh GeLU becomes one
``linear_gelu`` (``fxmegatron.ops.gemm_epilogue``), whose GEMM applies the bias and the GeLU
in its epilogue and whose backward computes the GeLU derivative and the bias gradient in one
pass.

The rule, as data (``RULE``), holds for a node ``linear(x, w, b)`` when

* ``b`` is not None (the epilogue adds it; a bias-free linear keeps ATen's GEMM),
* ``x``, ``w``, ``b`` and the output share a dtype, one of ``DTYPES`` (cuBLASLt's GeLU
  epilogues; fp32 and fp64 programs keep ATen's exact ops), ``w`` is 2-D and ``b`` one row,
* its only reader is ``gelu(·, approximate="tanh")`` taking it as the input (cuBLASLt's GeLU
  is the tanh form; erf GeLU stays), and the linear's output is read nowhere else (the op
  does not hand out the pre-activation).

Where a rule holds the two nodes become one; ``meta["gemm_epilogue"]`` on the new node names
the rule. Nothing else changes, so the rewrite runs on any graph: after the tensor-parallel
rewrite (a column-parallel linear's shard is a linear), inside recomputed regions, before
``fuse`` (a GeLU this takes is not a fused group's), and it counts what it did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.ops.gemm_epilogue import EPILOGUE_DTYPES, linear_gelu
from fxmegatron.passes.node_meta import copy_source

aten = torch.ops.aten


@dataclass(frozen=True)
class EpilogueRule:
    name: str
    producer: object          # the op whose output the epilogue consumes
    consumer: object          # the pointwise op the epilogue computes
    consumer_kwargs: Tuple[Tuple[str, object], ...]
    needs_bias: bool
    target: object            # the fused call


RULE = EpilogueRule("linear+gelu(tanh) -> cuBLASLt GELU_AUX_BIAS", aten.linear.default, aten.gelu.default,
                    (("approximate", "tanh"),), True, linear_gelu)
DTYPES = EPILOGUE_DTYPES


def _kwarg(n: fx.Node, name: str, pos: int, default):
    return n.kwargs.get(name, n.args[pos] if len(n.args) > pos else default)


def _match(n: fx.Node, rule: EpilogueRule, dtypes) -> Optional[fx.Node]:
    """The consumer that ``n`` (a producer) fuses with under ``rule``, or None."""
    if n.op != "call_function" or n.target is not rule.producer:
        return None
    bias = _kwarg(n, "bias", 2, None)
    if rule.needs_bias and not isinstance(bias, fx.Node):
        return None
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (n.args[0], n.args[1], bias, n)]
    if not all(isinstance(v, torch.Tensor) and v.dtype in dtypes and v.dtype == vals[0].dtype
               for v in vals if v is not None or rule.needs_bias):
        return None
    w, b = vals[1], vals[2]
    if w.dim() != 2 or (b is not None and tuple(b.shape) != (w.shape[0],)):
        return None
    users = list(n.users)
    if len(users) != 1:
        return None
    c = users[0]
    if c.op != "call_function" or c.target is not rule.consumer or c.args[0] is not n:
        return None
    if any(a is n for a in list(c.args[1:]) + list(c.kwargs.values())):
        return None
    if any(_kwarg(c, k, 1, "none") != v for k, v in rule.consumer_kwargs):
        return None
    return c


def apply_gemm_epilogues(gm: fx.GraphModule, dtypes=DTYPES) -> int:
    """Rewrite every match in ``gm`` and its recomputed regions; returns how many."""
    from fxmegatron.passes.recompute import rewrite_each_node
    return rewrite_each_node(gm, lambda graph, n: _fuse(graph, n, dtypes))


def _fuse(graph: fx.Graph, n: fx.Node, dtypes) -> bool:
    c = _match(n, RULE, dtypes)
    if c is None:
        return False
    x, w, b = n.args[0], n.args[1], _kwarg(n, "bias", 2, None)
    with graph.inserting_before(c):
        fused = graph.call_function(RULE.target, (x, w, b))
    fused.meta["val"] = c.meta["val"]
    copy_source(fused, c, also=("placement", "tp_rule"))
    fused.meta["gemm_epilogue"] = RULE.name
    c.replace_all_uses_with(fused)
    graph.erase_node(c)
    graph.erase_node(n)
    return True
