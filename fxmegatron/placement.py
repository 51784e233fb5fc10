"""How a tensor is laid out across the tensor-parallel group.

Placements are plain data stored on graph nodes (``node.meta["placement"]``),
so a dump can print, for every tensor, how it is split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""

    def __str__(self):
        return "R"


@dataclass(frozen=True)
class Shard:
    """Rank r holds slice r of ``dim``.

    ``blocks``: when ``dim`` is a concatenation of segments (a fused QKV
    projection that is later ``split``), each segment is sharded on its own, so
    rank r holds slice r of every segment, concatenated.
    """

    dim: int
    blocks: Optional[Tuple[int, ...]] = None

    def __str__(self):
        return f"S({self.dim})" if self.blocks is None else f"S({self.dim}, blocks={list(self.blocks)})"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the tensor is the sum over ranks."""

    def __str__(self):
        return "P(sum)"


Placement = Union[Replicate, Shard, Partial]
R = Replicate()
P = Partial()


def shard_slices(size: int, plc: Shard, rank: int, world: int):
    """(start, length) ranges of ``dim`` that rank ``rank`` holds, in order."""
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
    if plc.blocks is None:
        return torch.cat(list(shards), plc.dim)
    per_rank = [torch.split(s, [b // world for b in plc.blocks], plc.dim) for s in shards]
    segs = [torch.cat([per_rank[r][i] for r in range(world)], plc.dim) for i in range(len(plc.blocks))]
    return torch.cat(segs, plc.dim)


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
