"""Token ids and labels must lie inside the vocabulary, as the unmodified model requires.

The unmodified model raises ``IndexError`` on an embedding id or a cross-entropy label
outside its vocabulary. The parallel program would not: a vocab-parallel lookup gives zeros
for an id no rank owns, and a vocab-parallel cross-entropy finds the label on no rank and
counts its logit as 0, so a bad batch trains on as if it were good. ``id_checker`` finds,
in the captured graph, every embedding lookup and cross-entropy whose index (ids, or
target) is computed from the batch alone (HF models shift their labels inside the model:
the check sees the shifted labels, as the model's loss does) and makes one function that
computes those indices from a flat batch and raises ``BatchError`` naming the batch input,
the value found and the vocabulary size. ``ParallelModel`` runs it on the first steps
(``pm.id_checks``, default 3, like ``pm.batch_checks``): a few small integer ops on the ids.

Indices computed from weights or buffers, or from nothing in the batch (positions made by
``arange``), are not checked: they are the model's own, not the data's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from fxmegatron.capture import module_path, retarget_device
from fxmegatron.errors import BatchError

aten = torch.ops.aten
_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)


@dataclass
class IdRead:
    """One index the model reads from the batch: what reads it and its valid range."""

    what: str                     # "the embedding at node x in m" / "the cross-entropy at ..."
    rows: int                     # valid values are 0 .. rows - 1
    ignore: Optional[int]         # a label value the loss skips (ignore_index), or None
    inputs: List[int]             # positions of the flat batch it is computed from
    direct: bool                  # the index is a batch input itself (positions then name elements)
    index: Callable               # flat batch -> the index tensor


def _arg(n: fx.Node, i: int, name: str, default):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _from_batch(gm: fx.GraphModule, x, device) -> Optional[tuple]:
    """(flat batch -> value of ``x``, the placeholder positions it reads), when ``x`` is a node
    computed from the batch alone; else None."""
    if not isinstance(x, fx.Node):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    keep, stack = set(), [x]
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        if n.op in ("get_attr", "call_module"):
            return None
        keep.add(n)
        stack.extend(n.all_input_nodes)
    read = [i for i, p in enumerate(placeholders) if p in keep]
    if not read:
        return None
    g = fx.Graph()
    env = {p: g.placeholder(p.name) for p in placeholders}
    for n in gm.graph.nodes:
        if n in keep and n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[x])
    sub = retarget_device(fx.GraphModule(torch.nn.Module(), g), device)
    return sub, read


def _place(n: fx.Node) -> str:
    mod = module_path(n)
    return f"node {n.name}{' in ' + mod if mod else ''}"


def id_reads(gm: fx.GraphModule, device="cpu") -> List[IdRead]:
    """Every embedding id and loss label of ``gm`` (the captured graph) computed from the batch."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.embedding.default:
            table, idx, ignore = n.args[0], n.args[1], None
            rows = table.meta["val"].shape[0] if isinstance(table, fx.Node) and "val" in table.meta else None
            what = f"the embedding at {_place(n)}"
        elif n.target in _LOSSES:
            logits, idx = n.args[0], n.args[1]
            ignore = _arg(n, 4, "ignore_index", -100)
            v = logits.meta.get("val") if isinstance(logits, fx.Node) else None
            rows = None if v is None else v.shape[1 if v.ndim > 1 else 0]
            what = f"the cross-entropy at {_place(n)}"
        else:
            continue
        built = _from_batch(gm, idx, device) if rows is not None else None
        if built is None:
            continue
        sub, read = built
        out.append(IdRead(what, int(rows), ignore, read, idx in placeholders, sub))
    return out


def id_checker(gm: fx.GraphModule, names: Sequence[str], device="cpu") -> Optional[Callable]:
    """A function ``flat batch -> None`` that raises ``BatchError`` on an id or label outside
    the vocabulary (see the module doc), or None when the graph reads none from the batch."""
    reads = id_reads(gm, device)
    if not reads:
        return None

    def check(flat: Sequence, piece: str = "") -> None:
        with torch.no_grad():
            for r in reads:
                t = r.index(*flat)
                bad = (t < 0) | (t >= r.rows)
                if r.ignore is not None:
                    bad &= t != r.ignore
                if not bool(bad.any()):
                    continue
                at = bad.nonzero()[0].tolist()
                value = int(t[tuple(at)])
                src = " and ".join(repr(names[i]) for i in r.inputs)
                where = f" at {at}" if r.direct else f" (as the model reads it, computed from {src})"
                allowed = f"; {r.ignore}, its ignore_index, is allowed" if r.ignore is not None else ""
                raise BatchError(
                    f"batch input {src}{piece} holds {value}{where}, outside the vocabulary of {r.rows} rows that "
                    f"{r.what} reads (0..{r.rows - 1}{allowed}): the unmodified model raises IndexError on it, "
                    "where the parallel program would go on (a vocab-parallel lookup or loss finds the id on no "
                    "tensor-parallel rank and takes zeros); pm.id_checks: the first steps are checked")
    return check


def label_inputs(gm: fx.GraphModule) -> dict:
    """{flat batch position: ignore_index} of the inputs that only a cross-entropy's target is
    computed from (labels): setting one of their rows to the ignore_index leaves every
    other value of the graph as it was and takes that row out of the loss's count."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = {}
    for ce in (n for n in gm.graph.nodes if n.op == "call_function" and n.target in _LOSSES):
        below, stack = set(), [ce.args[1]]
        while stack:
            n = stack.pop()
            if isinstance(n, fx.Node) and n not in below:
                below.add(n)
                stack.extend(n.all_input_nodes)
        for i, p in enumerate(placeholders):
            reach, stack, only = set(), [p], True
            if p not in below:
                continue
            while stack and only:
                n = stack.pop()
                for u in n.users:
                    if u is ce:
                        continue
                    if u not in below:
                        only = False
                    elif u not in reach:
                        reach.add(u)
                        stack.append(u)
            if only:
                out[i] = _arg(ce, 4, "ignore_index", -100)
    return out
