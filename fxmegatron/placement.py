"""How a tensor is laid out across the ranks of one mesh axis, and over all of them.

A ``Placement`` says how a value lies over the ranks of one axis: ``Replicate``,
``Shard(dim)`` (a sequence shard of context parallelism included: ``Shard(dim, seq_inner=i)``,
load-balanced chunks) or ``Partial``. ``Placements`` is a value's layout on the whole mesh:
a placement per axis, an axis not named being Replicate. Placements are plain data stored
on graph nodes (``node.meta["placements"]``: a placement per axis that placed the node, read
with ``placed(node, axis)``), so a dump can print, for every tensor, how it is split. docs/ENGINE.md: the one placement engine this is the base of.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

import torch


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor.

    ``seq``: (dim, inner) where a whole value's sequence lies, dim laid out [outer, S, inner]
    (context parallelism knows it for the batch's inputs and what is computed from them: a
    cut along it takes no communication). None: not known, or not asked for."""

    seq: Optional[Tuple[int, int]] = None

    def __str__(self):
        if self.seq is None:
            return "R"
        d, inner = self.seq
        return f"R(seq@{d}{'' if inner == 1 else f', inner={inner}'})"


@dataclass(frozen=True)
class Shard:
    """Rank r holds slice r of ``dim``.

    ``blocks``: when ``dim`` is a concatenation of segments (a fused QKV
    projection that is later ``split``), each segment is sharded on its own, so
    rank r holds slice r of every segment, concatenated.

    ``seq_inner``: a sequence shard of context parallelism. ``dim`` is laid out as [outer,
    S, inner] (``inner`` = seq_inner; a flattened batch and sequence has 1), S is cut in 2·n
    chunks and rank r of n holds chunks r and 2·n−1−r, in that order (load-balanced causal
    attention). None: rank r holds the r-th contiguous slice.
    """

    dim: int
    blocks: Optional[Tuple[int, ...]] = None
    seq_inner: Optional[int] = None

    def __str__(self):
        if self.seq_inner is not None:
            return f"S({self.dim}, seq{'' if self.seq_inner == 1 else f' inner={self.seq_inner}'})"
        return f"S({self.dim})" if self.blocks is None else f"S({self.dim}, blocks={list(self.blocks)})"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the tensor is the reduction (``op``) over ranks."""

    op: str = "sum"

    def __str__(self):
        return f"P({self.op})"


Placement = Union[Replicate, Shard, Partial]
R = Replicate()
P = Partial()


@dataclass(frozen=True)
class Placements:
    """A value's layout on the mesh: its placement per axis ("tp", "cp", ...). An axis it
    does not name holds it replicated; ``Placements.of`` leaves plain ``R`` out, so two
    layouts are equal exactly when every axis places the value alike."""

    axes: Tuple[Tuple[str, Placement], ...] = ()

    @staticmethod
    def of(**by_axis: Optional[Placement]) -> "Placements":
        """The layout from a placement per axis (None or plain R: replicated there)."""
        return Placements(tuple(sorted((a, p) for a, p in by_axis.items() if p is not None and p != R)))

    def on(self, axis: str) -> Placement:
        """The placement on ``axis`` (R where none is named)."""
        return dict(self.axes).get(axis, R)

    def with_axis(self, axis: str, plc: Optional[Placement]) -> "Placements":
        """This layout with ``axis`` placed as ``plc``."""
        return Placements.of(**{**dict(self.axes), axis: plc})

    def sharded(self) -> Tuple[str, ...]:
        """The axes over which the value is cut (each rank holds a piece)."""
        return tuple(a for a, p in self.axes if isinstance(p, Shard))

    def __str__(self):
        return " ".join(f"{a}:{p}" for a, p in self.axes) or "R"


# ---- on graph nodes: meta["placements"], one entry per axis a pass placed the node on -----------
PLACEMENTS = "placements"


def placed(node, axis: str, default=None):
    """``node``'s placement on ``axis`` (a tuple of them for an op of several outputs), or
    ``default`` where no pass placed it on that axis (a node made after the axis's pass). None
    recorded is "no placement" (tp's slices of kv heads that ranks share)."""
    return node.meta.get(PLACEMENTS, {}).get(axis, default)


def place(node, axis: str, plc) -> None:
    """Record ``plc`` as ``node``'s placement on ``axis`` (a new dict: a node whose meta was
    copied from another does not share it)."""
    node.meta[PLACEMENTS] = {**node.meta.get(PLACEMENTS, {}), axis: plc}


def node_layout(node) -> Optional[Placements]:
    """``node``'s layout over every axis it is placed on, None if it is placed on none or has
    several outputs."""
    by_axis = node.meta.get(PLACEMENTS)
    if not by_axis or any(isinstance(p, tuple) for p in by_axis.values()):
        return None
    return Placements.of(**by_axis)


def shard_slices(size: int, plc: Shard, rank: int, world: int):
    """(start, length) ranges of ``dim`` that rank ``rank`` holds, in order."""
    if plc.seq_inner is not None:     # its chunks need the sequence length, which the placement does not hold
        raise ValueError(f"{plc}: a sequence shard's pieces are cut by fxmegatron.ops.context_parallel.cp_take")
    blocks = plc.blocks or (size,)
    out, base = [], 0
    for b in blocks:
        n = b // world
        out.append((base + rank * n, n))
        base += b
    return out


def take_shard(full: torch.Tensor, plc: Placement, rank: int, world: int) -> torch.Tensor:
    """The local piece of ``full`` for ``rank`` (no copy for a plain slice)."""
    if not isinstance(plc, Shard):
        return full
    parts = [full.narrow(plc.dim, s, n) for s, n in shard_slices(full.shape[plc.dim], plc, rank, world)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, plc.dim)


def join_shards(shards, plc: Placement) -> torch.Tensor:
    """Inverse of ``take_shard`` over all ranks: the full tensor from every rank's piece."""
    if not isinstance(plc, Shard):
        return shards[0]
    world = len(shards)
    if plc.seq_inner is not None:
        raise ValueError(f"{plc}: a sequence shard's chunks are put back in order by fxmegatron.verify.context")
    if plc.blocks is None:
        return torch.cat(list(shards), plc.dim)
    per_rank = [torch.split(s, [b // world for b in plc.blocks], plc.dim) for s in shards]
    segs = [torch.cat([per_rank[r][i] for r in range(world)], plc.dim) for i in range(len(plc.blocks))]
    return torch.cat(segs, plc.dim)


def take_layout(full: torch.Tensor, layout: Placements, coords: Mapping[str, Tuple[int, int]]) -> torch.Tensor:
    """The local piece of ``full`` for the rank at ``coords`` ({axis: (rank, size)}): cut along
    every axis the layout shards it over, in the layout's axis order (an axis missing from
    ``coords``, or of size 1, cuts nothing)."""
    out = full
    for axis in layout.sharded():
        rank, world = coords.get(axis, (0, 1))
        if world > 1:
            out = take_shard(out, layout.on(axis), rank, world)
    return out


def local_shape(shape, plc: Placement, world: int):
    shape = list(shape)
    if isinstance(plc, Shard):
        shape[plc.dim] //= world
    return shape


def placement_to_json(plc: Placement):
    """The JSON form of a parameter placement (checkpoints and stage folders): "R" or
    {"dim": d, "blocks": [...] or null}."""
    if isinstance(plc, Shard):
        return {"dim": plc.dim, "blocks": list(plc.blocks) if plc.blocks else None}
    return "R"


def placement_from_json(j) -> Placement:
    if j == "R":
        return R
    return Shard(j["dim"], tuple(j["blocks"]) if j["blocks"] else None)


def join_layout(pieces: Mapping[Tuple[int, ...], torch.Tensor], layout: Placements,
                degrees: Mapping[str, int]) -> torch.Tensor:
    """Inverse of ``take_layout`` over every rank: the full tensor from the pieces, keyed by
    the ranks on ``layout.sharded()`` (in that order; axes of degree 1 included). The last
    axis cut is joined first."""
    axes = layout.sharded()
    if not axes:
        return next(iter(pieces.values()))
    *outer, last = axes
    joined = {}
    for key in sorted({k[:-1] for k in pieces}):
        parts = [pieces[key + (r,)] for r in range(degrees.get(last, 1))]
        joined[key] = join_shards(parts, layout.on(last)) if len(parts) > 1 else parts[0]
    return join_layout(joined, Placements.of(**{a: layout.on(a) for a in outer}), degrees)


def layout_to_json(layout: Placements) -> dict:
    """The JSON form of a parameter's layout (checkpoints, stage folders): {axis: the axis's
    ``placement_to_json``} for every axis that shards it."""
    return {a: placement_to_json(layout.on(a)) for a in layout.sharded()}


def layout_from_json(j: Mapping[str, object]) -> Placements:
    return Placements.of(**{a: placement_from_json(p) for a, p in j.items()})
