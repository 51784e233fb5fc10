"""Under ``compile=True``: a table every layer reads (rotary cos and sin) computed once.

A rotary model computes cos(position × inverse frequency) and sin(...) once, in the model's
forward, and hands them to every layer. Compiled as one graph, inductor inlines that cheap
elementwise producer into each reader, and the partitioner recomputes it in the backward
rather than save it: each layer's rotary kernels, forward and backward, evaluate a sine and a
cosine per element of q and k. Per-layer ``torch.compile`` does not, because there the tables
arrive as the layer's inputs. This pass puts each such table behind
``fxmegatron::computed_once`` (the identity; ``ops/computed_once.py``), so it is one buffer,
computed once, saved once for the backward.

A *table* (precondition per node): a floating tensor computed from no parameter (only from
buffers, the batch and constants), through at least one transcendental op (cos, sin, exp, log,
pow, ...: what makes recomputing it cost arithmetic), read by a value that does depend on a
parameter, read by more than one op (through views: the layers' reads), and at most
``MAX_ELEMENTS`` elements (a bigger one, such as an ALiBi bias over s × s, stays as inductor
has it: memory before arithmetic). The op wraps the table's last
value-changing node (a cast to the model's dtype, say), below the views each reader takes of it.
Values are unchanged: the op returns a copy of its input.
"""
from __future__ import annotations

from typing import Dict, Set

import torch
import torch.fx as fx

from fxmegatron.ops.computed_once import computed_once
from fxmegatron.passes.node_meta import copy_source, is_parameter

aten = torch.ops.aten
MAX_ELEMENTS = 1 << 26
TRANSCENDENTAL = frozenset({
    aten.cos.default, aten.sin.default, aten.tan.default, aten.exp.default, aten.exp2.default,
    aten.expm1.default, aten.log.default, aten.log2.default, aten.log10.default, aten.log1p.default,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.tanh.default,
    aten.sigmoid.default, aten.erf.default, aten.atan.default, aten.sqrt.default, aten.rsqrt.default,
})
# ops that change a tensor's shape, not its values: the table is taken below them
SHAPE_ONLY = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.expand.default, aten.transpose.int, aten.permute.default,
    aten.slice.Tensor, aten.select.int, aten.alias.default, aten.t.default, aten.detach.default,
})


def _same_dtype_cast(n: fx.Node) -> bool:
    if n.target not in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.to.device):
        return False
    src, out = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None, n.meta.get("val")
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype \
        and src.device == out.device


def _shape_only(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target in SHAPE_ONLY or _same_dtype_cast(n))


def _static_nodes(gm: fx.GraphModule) -> Dict[fx.Node, bool]:
    """Every node computed from no parameter -> whether a transcendental op is on its way."""
    costly: Dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or (n.op == "get_attr" and not is_parameter(gm, n)):
            costly[n] = False
        elif n.op == "call_function" and all(a in costly for a in n.all_input_nodes):
            costly[n] = n.target in TRANSCENDENTAL or any(costly[a] for a in n.all_input_nodes)
    return costly


def _table(n: fx.Node, costly: Dict[fx.Node, bool]):
    """The node under ``n``'s shape-only chain, if it is a table; else None."""
    while _shape_only(n) and isinstance(n.args[0], fx.Node) and n.args[0] in costly:
        n = n.args[0]
    v = n.meta.get("val")
    if n.op != "call_function" or not costly.get(n) or not isinstance(v, torch.Tensor):
        return None
    if not v.is_floating_point() or v.numel() > MAX_ELEMENTS or n.target is computed_once._opoverload:
        return None
    return n


def _readers(n: fx.Node) -> int:
    """How many ops read ``n``, looking through the shape-only ops on the way."""
    return sum(_readers(u) if _shape_only(u) else 1 for u in n.users)


def compute_tables_once(gm: fx.GraphModule) -> int:
    """Wrap each table of ``gm`` (the module docstring says which) in ``computed_once``; returns
    how many."""
    costly = _static_nodes(gm)
    tables: Set[fx.Node] = set()
    for n in costly:
        if any(u not in costly for u in n.users):
            t = _table(n, costly)
            if t is not None and _readers(t) > 1:
                tables.add(t)
    op = computed_once._opoverload
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for t in sorted(tables, key=order.__getitem__):
        with gm.graph.inserting_after(t):
            once = gm.graph.call_function(op, (t,))
        once.meta["val"] = torch.empty_like(t.meta["val"])
        copy_source(once, t, also=("placements", "tp_rule"))
        t.replace_all_uses_with(once, delete_user_cb=lambda u: u is not once)
    if tables:
        gm.graph.lint()
        gm.recompile()
    return len(tables)
