"""Where the sequence is in a tensor, and how views move it, in the placements of every axis
(``fxmegatron.placement``) on the cp axis.

A value's dim ``d`` laid out as [outer, S, inner] (S the traced sequence length; a flattened
batch and sequence is dim 0, inner 1, of an [B·S, ...] tensor) holds the sequence. This rank's
load-balanced chunks of it are ``Shard(d, seq_inner=inner)`` (``seq(d, inner)``); a value
computed whole on every rank whose sequence is merely known (the batch's labels, say) is
``Replicate(seq=(d, inner))`` (``seq(d, inner, split=False)``). A summand per cp rank (a loss
over its tokens) is ``P``. Anything else (``R``) does not depend on the position in the
sequence, or its sequence dim is not known; a whole tensor meeting a split one is taken apart
by broadcasting alignment, not by this record.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from fxmegatron.placement import Placement, Replicate, Shard


def seq(dim: int, inner: int = 1, split: bool = True) -> Placement:
    """The placement of a value whose ``dim`` holds the sequence: this rank's chunks (``split``)
    or the whole of it."""
    return Shard(dim, seq_inner=inner) if split else Replicate(seq=(dim, inner))


def seq_of(p) -> Optional[Tuple[int, int]]:
    """(dim, inner) of the sequence in a placement that holds it (a sequence shard, or a whole
    value whose sequence is known); None for any other (R, P, a tuple of several outputs')."""
    if isinstance(p, Shard) and p.seq_inner is not None:
        return (p.dim, p.seq_inner)
    if isinstance(p, Replicate):
        return p.seq
    return None


def is_split(p) -> bool:
    """Whether ``p`` is this rank's chunks of the sequence."""
    return isinstance(p, Shard) and p.seq_inner is not None


def seq_at(p: Placement, dim: int) -> Placement:
    """``p`` (holding the sequence) with its sequence moved to ``dim``."""
    d, inner = seq_of(p)
    return seq(dim, inner, is_split(p))


def seq_through_view(in_shape: Sequence[int], p: Placement, out_shape: Sequence[int],
                     n_seq: int) -> Optional[Placement]:
    """The placement after a reshape of ``in_shape`` to ``out_shape`` (row-major element order
    is kept) of a value whose sequence (``n_seq`` long) ``p`` holds, or None when the reshape
    cuts the sequence axis apart (it then spans two output dims, or shares a dim in a way that
    is not [outer, S, inner])."""
    d, inner = seq_of(p)
    stride = inner * math.prod(in_shape[d + 1:])       # elements between consecutive positions
    suffix = 1
    for k in range(len(out_shape) - 1, -1, -1):
        size = out_shape[k]
        if stride % suffix == 0 and (suffix * size) % (stride * n_seq) == 0 and stride * n_seq <= suffix * size:
            return seq(k, stride // suffix, is_split(p))
        suffix *= size
        if suffix > stride * n_seq:
            break
    return None


def local_size(size: int, cp: int) -> int:
    return size // cp


def join_sequence(values: Sequence[torch.Tensor], s: Placement, seq: int) -> torch.Tensor:
    """The inverse of ``cp_take``: rank r's sequence dim d of ``s`` is [outer, chunk r and chunk
    2·cp−1−r, inner]; the whole is [outer, chunks 0 .. 2·cp−1, inner]."""
    cp = len(values)
    (d, inner), c = seq_of(s), seq // (2 * cp)
    shape = list(values[0].shape)
    outer = shape[d] // (2 * c * inner)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * cp)
    for r, v in enumerate(values):
        y = v.reshape(shape[:d] + [outer, 2, c, inner] + shape[d + 1:])
        chunks[r], chunks[2 * cp - 1 - r] = y.select(d + 1, 0), y.select(d + 1, 1)
    whole = torch.stack(chunks, d + 1)
    return whole.reshape(shape[:d] + [shape[d] * cp] + shape[d + 1:])
