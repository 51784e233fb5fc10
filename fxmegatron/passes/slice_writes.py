"""A fresh buffer filled by writes into its slices, then read whole, as one ``cat``.

Some models build a tensor in place: HF DeepSeek-V3's attention makes its keys as
``k = k_pass.new_empty(shape); k[..., :a] = k_pass; k[..., a:] = k_rot``, and torch.export keeps
that as an allocation, ``slice`` views of it and in-place ``copy_`` nodes, with the reader of the
buffer (attention) reading the allocation node itself. The placement passes reason about the
values nodes compute, and an allocation computes none: they would cut the buffer by heads
while the writes put whole-head values into it. Before them this pass states the same value
functionally: ``cat([src₀ as slice₀, src₁ as slice₁, ...], dim)``.

Precondition, per allocation (``empty``/``zeros`` forms; a buffer that does not meet it is left
as it is, and a later pass names what it cannot place):

* every user is either a ``slice`` of it (step 1) whose only user is a ``copy_`` into that slice
  whose result nobody reads, or a reader that comes after every such ``copy_``;
* the slices are along one dim and tile it exactly, with no overlap.

Then nothing reads the buffer before it is whole, and every element read is one a write put
there: the ``cat`` computes the same tensor (each source cast to the buffer's dtype and
broadcast to its slice, as ``copy_`` does).
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx as fx

aten = torch.ops.aten
ALLOCATIONS = {aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default, aten.zeros.default,
               aten.empty_like.default, aten.zeros_like.default}


def _writes(buf: fx.Node):
    """([(slice, copy_)], readers) of ``buf``, or None when a user is neither."""
    writes, readers = [], []
    for u in buf.users:
        copy = next(iter(u.users)) if len(u.users) == 1 else None
        if (u.target is aten.slice.Tensor and u.args[0] is buf and copy is not None
                and copy.target is aten.copy_.default and copy.args[0] is u and not copy.users
                and (u.args[4] if len(u.args) > 4 else 1) == 1):
            writes.append((u, copy))
        else:
            readers.append(u)
    return writes, readers


def _tiles(writes, size: int, nd: int):
    """The writes sorted along their one dim when they tile [0, size) exactly, else None."""
    spans = []
    for s, c in writes:
        dim = s.args[1] if len(s.args) > 1 else 0
        dim = dim + nd if dim < 0 else dim
        start = s.args[2] if len(s.args) > 2 and s.args[2] is not None else 0
        end = s.args[3] if len(s.args) > 3 and s.args[3] is not None else sys.maxsize
        if not all(isinstance(x, int) for x in (start, end)):
            return None
        spans.append((dim, min(max(start + size[dim] if start < 0 else start, 0), size[dim]),
                      min(end + size[dim] if end < 0 else end, size[dim]), s, c))
    if len({d for d, *_ in spans}) != 1:
        return None
    spans.sort(key=lambda x: x[1])
    at = 0
    for _, a, b, *_ in spans:
        if a != at or b <= a:
            return None
        at = b
    return spans if at == size[spans[0][0]] else None


def slice_writes_to_cat(gm: fx.GraphModule) -> int:
    """Rewrite every buffer that meets the precondition; returns how many."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for buf in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ALLOCATIONS]:
        val = buf.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        writes, readers = _writes(buf)
        spans = _tiles(writes, tuple(val.shape), val.dim()) if writes else None
        if spans is None:
            continue
        last = max((c for *_, c in spans), key=order.get)
        if any(order[r] < order[last] for r in readers) or not all(
                isinstance(c.args[1], fx.Node) and isinstance(c.args[1].meta.get("val"), torch.Tensor)
                for *_, c in spans):
            continue
        mode = getattr(val, "fake_mode", None) or contextlib.nullcontext()
        pieces, at = [], last
        for dim, _, _, s, c in spans:
            piece, sv, shape = c.args[1], c.args[1].meta["val"], tuple(s.meta["val"].shape)
            if sv.dtype != val.dtype:       # copy_ casts to the buffer's dtype
                with gm.graph.inserting_after(at):
                    piece = at = gm.graph.call_function(aten._to_copy.default, (piece,), {"dtype": val.dtype})
                with mode:
                    piece.meta = {**c.meta, "val": sv.to(val.dtype)}
                sv = piece.meta["val"]
            if tuple(sv.shape) != shape:    # and broadcasts to the slice
                with gm.graph.inserting_after(at):
                    piece = at = gm.graph.call_function(aten.expand.default, (piece, list(shape)))
                with mode:
                    piece.meta = {**c.meta, "val": sv.expand(shape)}
            pieces.append(piece)
        with gm.graph.inserting_after(at):
            cat = gm.graph.call_function(aten.cat.default, (pieces, spans[0][0]))
        cat.meta = {**buf.meta, "val": val}
        for r in readers:
            r.replace_input_with(buf, cat)
        for _, _, _, s, c in spans:
            gm.graph.erase_node(c)
            gm.graph.erase_node(s)
        gm.graph.erase_node(buf)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done

