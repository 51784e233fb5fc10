"""Under ``compile=True``: sibling linears that read one input become one GEMM.

Hugging Face's attention projects its input three times (``q_proj``, ``k_proj``, ``v_proj``);
with grouped-query attention k and v are narrow (256 or 512 columns), and a GEMM that narrow
runs far below the GPU's rate, as does the backward's input gradient, three GEMMs and two
adds. One GEMM over the weights concatenated by rows computes every output element as the
same dot product, and its backward's input gradient is one GEMM whose reduction runs over all
three widths at once. Per-layer ``torch.compile`` keeps the three. (One H200, the training
step of ``benchmarks/end_to_end.py``: 0.6-1.0% faster on the Llama-1B and Qwen2-1.5B shapes;
merging a SwiGLU's equal gate and up too made the Qwen2 step 1.6% slower: docs/COMPILE.md.)

A *group* (preconditions, all per node):

* two or more ``aten.linear(x, w, b)`` nodes reading the same ``x`` node, their weights 2-D
  with the same input width, every weight (and every bias) a parameter of the module
  (``get_attr``; a weight gathered by ``dp_shard`` or cast by FP8 stays: concatenating a
  gathered weight would keep the whole of it for the backward), all of one dtype, either all
  biased or none;
* siblings: the linears' modules share a parent module (a recompute policy that selects
  module paths sees one module's linears together);
* ``widths`` holds: with ``"narrow"`` (the default), some member is at most half as wide as
  the widest (what the measurement above found pays: wide equal halves such as a SwiGLU's
  gate and up already run at the GEMM's rate, and gain less than the copies of their
  concatenated weights and gradients cost); ``"all"`` merges any group.

Each group becomes ``cat`` of the weights (and biases), one ``linear``, and per member a
``slice`` of its columns and a ``clone`` of the slice, in the members' order; the member's
readers read the clone. The clone is why the merged output is not kept for the backward: a
slice is a view, and a view that an opaque op saves (the attention kernel saves its v) would
keep the whole merged output alive, q and k columns included (+0.85 GiB on the Llama-1B shape,
measured); inductor fuses a clone into an elementwise reader (q's and k's rotary) and copies
only where the reader needs a buffer of its own (v: a 512-column copy a layer). Values are the
same dot products (the GEMM may order its reduction differently, as any two cuBLAS calls may).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxmegatron.capture import module_path
from fxmegatron.passes.node_meta import copy_source, is_parameter

aten = torch.ops.aten
WIDTHS = ("narrow", "all")


def _parts(n: fx.Node):
    """(x, w, b) of ``aten.linear(x, w, b)``, or None."""
    if n.op != "call_function" or n.target is not aten.linear.default:
        return None
    b = n.kwargs.get("bias", n.args[2] if len(n.args) > 2 else None)
    return n.args[0], n.args[1], b


def _parent(n: fx.Node) -> str:
    return module_path(n).rpartition(".")[0]


def _candidate(gm: fx.GraphModule, n: fx.Node):
    """The group key of a linear that may merge, or None."""
    parts = _parts(n)
    if parts is None:
        return None
    x, w, b = parts
    if not isinstance(x, fx.Node) or not is_parameter(gm, w) or (b is not None and not is_parameter(gm, b)):
        return None
    wv = w.meta.get("val")
    if not isinstance(wv, torch.Tensor) or wv.dim() != 2 or not module_path(n):
        return None
    return x, _parent(n), wv.shape[1], wv.dtype, b is not None


def _widths_pay(widths: List[int], rule: str) -> bool:
    return rule == "all" or min(widths) * 2 <= max(widths)


def _merge(gm: fx.GraphModule, members: List[fx.Node]) -> None:
    g = gm.graph
    xs, ws, bs = zip(*(_parts(n) for n in members))
    x = xs[0]
    vals = [w.meta["val"] for w in ws]
    widths = [v.shape[0] for v in vals]
    mode = detect_fake_mode([x.meta["val"], *vals])
    with mode:
        wcat = torch.cat(vals)
        bcat = torch.cat([b.meta["val"] for b in bs]) if bs[0] is not None else None
        y = torch.nn.functional.linear(x.meta["val"], wcat, bcat)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        outs = [y.narrow(-1, s, k) for s, k in zip(starts, widths)]
        own_vals = {n: o.clone(memory_format=torch.contiguous_format) for n, o in zip(members, outs)}
    first = members[0]
    for a in (*ws, *(bs if bs[0] is not None else ())):
        if a.op == "get_attr":          # no inputs: defined before the first member is always safe
            first.prepend(a)
    with g.inserting_before(first):
        wn = g.call_function(aten.cat.default, (list(ws),))
        args = (x, wn)
        if bs[0] is not None:
            bn = g.call_function(aten.cat.default, (list(bs),))
            bn.meta["val"] = bcat
            copy_source(bn, first)
            args = (x, wn, bn)
        merged = g.call_function(aten.linear.default, args)
    wn.meta["val"], merged.meta["val"] = wcat, y
    copy_source(wn, first)
    copy_source(merged, first)
    merged.meta["merged_linears"] = [module_path(n) for n in members]
    for n, s, k, out in zip(members, starts, widths, outs):
        with g.inserting_after(merged):
            piece = g.call_function(aten.slice.Tensor, (merged, -1, s, s + k))
        with g.inserting_after(piece):
            own = g.call_function(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format})
        piece.meta["val"], own.meta["val"] = out, own_vals[n]
        copy_source(piece, n, also=("placements", "tp_rule"))
        copy_source(own, n, also=("placements", "tp_rule"))
        n.replace_all_uses_with(own)
        g.erase_node(n)


def merge_linears(gm: fx.GraphModule, widths: str = "narrow") -> int:
    """Merge each group of sibling linears (module docstring) into one; returns how many groups."""
    if widths not in WIDTHS:
        raise ValueError(f"merge_linears: widths={widths!r}, expected one of {WIDTHS}")
    groups: Dict[Tuple, List[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        key = _candidate(gm, n)
        if key is not None:
            groups[key].append(n)
    merged = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        if _widths_pay([m.args[1].meta["val"].shape[0] for m in members], widths):
            _merge(gm, members)
            merged += 1
    if merged:
        g = gm.graph
        g.lint()
        gm.recompile()
    return merged
