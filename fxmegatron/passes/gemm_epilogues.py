"""Under ``compile=True`` on CUDA: a biased GEMM whose only reader is a tanh GeLU becomes one
``linear_gelu`` (``fxmegatron.ops.gemm_epilogue``), whose GEMM applies the bias and the GeLU
in its epilogue and whose backward computes the GeLU derivative and the bias gradient in one
pass.

The rule (``_match``; ``RULE`` names it in ``meta["gemm_epilogue"]``) holds for a GEMM when

* it is ``linear(x, w, b)`` with a bias, or ``addmm(b, x, w)`` with β = α = 1 whose one
  reader is a view of its output back to the activation's shape (Hugging Face's ``Conv1D``:
  GPT-2 and its relatives), w then [k, n]; a bias-free linear keeps ATen's GEMM;
* ``x``, ``w``, ``b`` and the output share a dtype, one of ``DTYPES`` (cuBLASLt's GeLU
  epilogues; fp32 and fp64 programs keep ATen's exact ops), ``w`` is 2-D and ``b`` one row
  of the output's width;
* its output's only reader is ``gelu(·, approximate="tanh")`` taking it as the input
  (cuBLASLt's GeLU is the tanh form; erf GeLU stays; ``passes/gelu_formula.py`` turns a
  written-out tanh GeLU into this op first), read nowhere else (the op does not hand out
  the pre-activation).

Where the rule holds, the GEMM and the GeLU become one call (an addmm's view stays, after
it). Nothing else changes, so the rewrite runs on any graph: after the tensor-parallel
rewrite (a column-parallel linear's shard is a linear), inside recomputed regions, before
``fuse`` (a GeLU this takes is not a fused group's), and it counts what it did.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxmegatron.ops.gemm_epilogue import EPILOGUE_DTYPES, linear_gelu
from fxmegatron.passes.node_meta import copy_source
from fxmegatron.passes.views import is_view

aten = torch.ops.aten


RULE = "linear+gelu(tanh) -> cuBLASLt GELU_AUX_BIAS"
DTYPES = EPILOGUE_DTYPES


def _kwarg(n: fx.Node, name: str, pos: int, default):
    return n.kwargs.get(name, n.args[pos] if len(n.args) > pos else default)


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _operands(n: fx.Node):
    """(x, w, b, w_is_k_by_n, out): a biased GEMM's operands, as ``linear(x, w [n, k], b)``
    or as ``addmm(b, x, w [k, n])`` (GPT-2's ``Conv1D``), and the node its GeLU reads:
    the linear, or the one view of the addmm's 2-D output back to the activation's shape."""
    if n.op != "call_function":
        return None
    if n.target is aten.linear.default:
        b = _kwarg(n, "bias", 2, None)
        return (n.args[0], n.args[1], b, False, n) if isinstance(b, fx.Node) else None
    if n.target is aten.addmm.default and len(n.args) == 3 and not n.kwargs:
        view = _only_user(n)
        if view is None or not is_view(view) or view.args[0] is not n:
            return None
        return n.args[1], n.args[2], n.args[0], True, view
    return None


def _match(n: fx.Node, dtypes):
    """(x, w, b, w_is_k_by_n, the GEMM's reader, the GeLU) when ``n`` is a GEMM of the rule
    (module docstring), or None."""
    found = _operands(n)
    if found is None:
        return None
    x, w, b, k_by_n, out = found
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, w, b, n)]
    if not all(isinstance(v, torch.Tensor) and v.dtype in dtypes and v.dtype == vals[0].dtype for v in vals):
        return None
    width = vals[1].shape[1] if k_by_n else vals[1].shape[0]
    if vals[1].dim() != 2 or tuple(vals[2].shape) != (width,) or (k_by_n and vals[0].dim() != 2):
        return None
    c = _only_user(out)
    if c is None or c.op != "call_function" or c.target is not aten.gelu.default or c.args[0] is not out:
        return None
    if any(a is out for a in list(c.args[1:]) + list(c.kwargs.values())):
        return None
    if _kwarg(c, "approximate", 1, "none") != "tanh":
        return None
    return x, w, b, k_by_n, out, c


def apply_gemm_epilogues(gm: fx.GraphModule, dtypes=DTYPES) -> int:
    """Rewrite every match in ``gm`` and its recomputed regions; returns how many."""
    from fxmegatron.passes.recompute import rewrite_each_node
    return rewrite_each_node(gm, lambda graph, n: _fuse(graph, n, dtypes))


def _fuse(graph: fx.Graph, n: fx.Node, dtypes) -> bool:
    found = _match(n, dtypes)
    if found is None:
        return False
    x, w, b, k_by_n, out, c = found
    with graph.inserting_before(c):
        if k_by_n:              # linear_gelu takes w as a linear does, [n, k]: the transposed view
            w = graph.call_function(aten.t.default, (w,))
            w.meta["val"] = w.args[0].meta["val"].t()
        fused = graph.call_function(linear_gelu, (x, w, b))
        fused.meta["val"] = n.meta["val"] if k_by_n else c.meta["val"]
        result = fused
        if k_by_n:              # back to the activation's shape, as the addmm's view did
            result = graph.call_function(out.target, (fused, *out.args[1:]), dict(out.kwargs))
            result.meta["val"] = c.meta["val"]
            copy_source(result, c, also=("placements", "tp_rule"))
    copy_source(fused, c, also=("placements", "tp_rule"))
    fused.meta["gemm_epilogue"] = RULE
    c.replace_all_uses_with(result)
    for dead in (c, out, n) if k_by_n else (c, n):
        graph.erase_node(dead)
    return True
