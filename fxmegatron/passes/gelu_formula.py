"""Under ``compile=True``: the tanh GeLU written out as a formula becomes ``aten.gelu(x,
approximate="tanh")``, so the GeLU passes after it (``gemm_epilogues``, ``fuse``,
``gelu_for_inductor``) see it.

Hugging Face's ``gelu_new`` (``NewGELUActivation``: GPT-2, GPT-J, CodeGen, Phi, ...) is
½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), traced into eight ATen ops:
``mul(x, 0.5)``, ``pow(x, 3)``, ``mul(·, 0.044715)``, ``add(x, ·)``, ``mul(·, √(2/π))``,
``tanh``, ``add(·, 1)``, ``mul(·, ·)``. The rule (``_match``) holds when

* the chain is exactly that, each product and sum with its operands in either order, and
  each constant equal to the formula's once both are rounded to the precision the ops
  compute in: fp32 for fp32, bf16 and fp16 tensors (ATen's kernels take a Python scalar in
  their fp32 math type), fp64 for fp64;
* every node of the chain but the last is read only by the next step of the chain (a
  value read elsewhere would have to stay);
* x is a floating-point tensor.

Numbers: inductor compiles such a chain into one kernel that computes in fp32 and rounds
once, and ``aten.gelu`` does the same. So the rewrite changes what a compiled program
computes by no more than the order of fp32 operations. Outside ``compile=True`` a bf16
program rounds after every op, and the pass does not run there.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.passes.node_meta import copy_source

aten = torch.ops.aten

SQRT_2_OVER_PI, CUBE_COEFF = math.sqrt(2 / math.pi), 0.044715   # the formula's own constants


def _is(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _operands(n: fx.Node, target, const: float, dtype) -> Optional[fx.Node]:
    """The tensor operand of ``n`` = ``target(t, c)`` or ``target(c, t)`` with c equal to
    ``const`` in ``dtype``; else None."""
    if not _is(n, target) or len(n.args) != 2 or n.kwargs:
        return None
    for t, c in (n.args, n.args[::-1]):
        if isinstance(t, fx.Node) and isinstance(c, (int, float)) and not isinstance(c, bool):
            same = torch.tensor(c, dtype=dtype) == torch.tensor(const, dtype=dtype)
            return t if bool(same) else None
    return None


def _only_reader(n: fx.Node, reader: fx.Node) -> bool:
    return list(n.users) == [reader]


def _match(out: fx.Node) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """(x, the chain's other nodes, last first) when ``out`` ends the formula (module
    docstring), else None."""
    if not _is(out, aten.mul.Tensor) or len(out.args) != 2 or out.kwargs:
        return None
    v = out.meta.get("val")
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return None
    dtype = torch.promote_types(v.dtype, torch.float32)       # what the constants are taken in
    for half, one_plus in (out.args, out.args[::-1]):
        if not (isinstance(half, fx.Node) and isinstance(one_plus, fx.Node)):
            continue
        x = _operands(half, aten.mul.Tensor, 0.5, dtype)
        t = _operands(one_plus, aten.add.Tensor, 1.0, dtype)
        xv = x.meta.get("val") if x is not None else None
        if not isinstance(xv, torch.Tensor) or xv.dtype != v.dtype or not _is(t, aten.tanh.default):
            continue
        inner = _operands(t.args[0], aten.mul.Tensor, SQRT_2_OVER_PI, dtype)
        if not _is(inner, aten.add.Tensor) or len(inner.args) != 2 or inner.kwargs:
            continue
        for a, b in (inner.args, inner.args[::-1]):
            cube = _operands(b, aten.mul.Tensor, CUBE_COEFF, dtype) if isinstance(b, fx.Node) else None
            if a is x and _is(cube, aten.pow.Tensor_Scalar) and cube.args[0] is x and cube.args[1] in (3, 3.0):
                chain = [(half, out), (one_plus, out), (t, one_plus), (t.args[0], t), (inner, t.args[0]),
                         (b, inner), (cube, b)]
                if all(_only_reader(n, r) for n, r in chain):
                    return x, [one_plus, half, t, t.args[0], inner, b, cube]
    return None


def gelu_formula_to_op(gm: fx.GraphModule) -> int:
    """Rewrite each written-out tanh GeLU of ``gm`` and of its recomputed regions; returns
    how many."""
    from fxmegatron.passes.recompute import rewrite_each_node
    return rewrite_each_node(gm, _rewrite)


def _rewrite(graph: fx.Graph, out: fx.Node) -> bool:
    found = _match(out)
    if found is None:
        return False
    x, chain = found
    with graph.inserting_before(out):
        gelu = graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
    gelu.meta["val"] = out.meta["val"]
    copy_source(gelu, out, also=("placements", "tp_rule"))
    out.replace_all_uses_with(gelu)
    graph.erase_node(out)
    for n in chain:          # each read only by the one erased before it
        graph.erase_node(n)
    return True
