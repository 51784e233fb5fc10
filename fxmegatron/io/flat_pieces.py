"""What each data-parallel rank writes of a sharded model, without gathering anything.

Under ``dp_shard`` a rank holds flat ranges of its (tp, pp) piece of a tensor: under "full" its
shard of every parameter and of its optimizer state (``ops.dp_gather.take_shard``: elements
``[rank·s, rank·s + s)`` of the flattened piece, zero-padded at the end); under "optimizer" and
"gradients" the segments of ``ShardedAdamW`` (elements ``[start, stop)`` of a parameter). A
checkpoint stores each range as it is, with ``"flat": [start, stop]`` and the piece's shape
(``"local"``) in its metadata; the reader puts the ranges of a piece together again
(``join_flat``) before the per-axis reassembly. So a sharding group of W ranks writes W files
of 1/W each, and no rank ever holds another's share.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from fxmegatron.errors import CheckpointError
from fxmegatron.ops.dp_gather import shard_length

FIELDS = ("exp_avg", "exp_avg_sq", "master")


def shard_group(pm):
    """The axis whose ranks share out the model's state (dp × cp, or one replica group's under
    hybrid sharding), and whether this rank is in the replica group that writes."""
    axes = pm.program.axes
    group = axes.get("dp_cp", axes["dp"])
    replica = axes.get("dp_replicate")
    return group, replica is None or replica.rank == 0


def param_ranges(pm, name: str, p: torch.Tensor) -> Iterator[Tuple[int, int, torch.Tensor]]:
    """``(start, stop, values)`` of parameter ``name``'s piece that this rank holds as a flat
    shard (``dp_shard="full"``); nothing when it holds the piece whole."""
    shape = pm.program.dp_shards.get(name) if pm.dp_shard == "full" else None
    if shape is None or p.dim() == 0:
        return
    group = pm.program.shard_axis(name)      # dp × cp, or an expert weight's edp group
    n, s = math.prod(shape), shard_length(math.prod(shape), group.size)
    start, stop = min(group.rank * s, n), min(group.rank * s + s, n)
    yield start, stop, p.detach().reshape(-1)[:stop - start]


def optimizer_ranges(optimizer) -> Dict[int, Dict[str, List[Tuple[int, int, torch.Tensor]]]]:
    """Per parameter (by id), per state field, the ``(start, stop, values)`` ranges this rank's
    ``ShardedAdamW`` holds (its segments)."""
    out: Dict[int, Dict[str, list]] = {}
    for i, s in enumerate(optimizer.segments):
        fields = out.setdefault(id(s.param), {f: [] for f in FIELDS})
        for f in FIELDS:
            fields[f].append((s.start, s.stop, optimizer.segment_state(i, f)))
    return out


def flat_meta(meta: dict, start: int, stop: int, local: Sequence[int]) -> dict:
    return {**meta, "flat": [start, stop], "local": list(local)}


def join_flat(where: str, parts: Sequence[Tuple[int, int, torch.Tensor]], local: Sequence[int]) -> torch.Tensor:
    """A (tp, pp) piece of shape ``local`` from its flat ranges, which must tile it exactly."""
    n = math.prod(local)
    parts = sorted((a, b, t) for a, b, t in parts if b > a)
    at = 0
    for a, b, t in parts:
        if a != at or t.numel() != b - a:
            raise CheckpointError(f"{where}: its flat pieces do not tile the tensor: elements [{at}, {a}) "
                                  f"missing or a piece of {t.numel()} elements at [{a}, {b})")
        at = b
    if at != n:
        raise CheckpointError(f"{where}: its flat pieces end at element {at} of {n}")
    if not parts:
        return torch.empty(tuple(local))
    return torch.cat([t.reshape(-1) for _, _, t in parts]).view(tuple(local))
