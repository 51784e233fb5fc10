"""Where the sequence is in a tensor, and how views move it.

``Seq(dim, inner, split)``: ``dim`` of the tensor is laid out as [outer, S, inner] (S the
traced sequence length; a flattened batch and sequence is ``Seq(0, 1)`` of an [B·S, ...]
tensor). ``split``: this rank holds its chunks of S only; else the tensor is computed
whole on every rank (the batch's labels, say) and its sequence is merely known.
``PARTIAL``: every cp rank holds a summand of the value (a loss over its tokens).
Anything else (``WHOLE``) does not depend on the position in the sequence, or its
sequence dim is not known; a whole tensor meeting a split one is taken apart by
broadcasting alignment, not by this record.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from fxmegatron.placement import P, Placement, R, Replicate, Shard


@dataclass(frozen=True)
class Seq:
    dim: int
    inner: int = 1
    split: bool = True

    def __str__(self):
        return f"{'S' if self.split else 'F'}eq({self.dim}{'' if self.inner == 1 else f', inner={self.inner}'})"

    def at(self, dim: int) -> "Seq":
        return replace(self, dim=dim)


@dataclass(frozen=True)
class _Mark:
    name: str

    def __str__(self):
        return self.name


WHOLE = _Mark("whole")
PARTIAL = _Mark("partial(sum over cp)")


def seq_through_view(in_shape: Sequence[int], s: Seq, out_shape: Sequence[int], seq: int) -> Optional[Seq]:
    """The sequence's place after a reshape of ``in_shape`` to ``out_shape`` (row-major
    element order is kept), or None when the reshape cuts the sequence axis apart (it then
    spans two output dims, or shares a dim in a way that is not [outer, S, inner])."""
    stride = s.inner * math.prod(in_shape[s.dim + 1:])       # elements between consecutive positions
    suffix = 1
    for k in range(len(out_shape) - 1, -1, -1):
        size = out_shape[k]
        if stride % suffix == 0 and (suffix * size) % (stride * seq) == 0 and stride * seq <= suffix * size:
            return Seq(k, stride // suffix, s.split)
        suffix *= size
        if suffix > stride * seq:
            break
    return None


def local_size(size: int, cp: int) -> int:
    return size // cp


def to_placement(p):
    """The per-axis placement (``fxmegatron.placement``) on the cp axis of a cp placement:
    this rank's chunks ``Seq(d, i)`` -> ``Shard(d, seq_inner=i)``; a whole value whose sequence
    is known ``Seq(d, i, split=False)`` -> ``Replicate(seq=(d, i))``; ``WHOLE`` -> R;
    ``PARTIAL`` -> P; a tuple (an op of several outputs) element by element."""
    if isinstance(p, tuple):
        return tuple(to_placement(x) for x in p)
    if isinstance(p, Seq):
        return Shard(p.dim, seq_inner=p.inner) if p.split else Replicate(seq=(p.dim, p.inner))
    if p is WHOLE:
        return R
    if p is PARTIAL:
        return P
    raise ValueError(f"not a context-parallel placement: {p!r}")


def from_placement(p: Placement):
    """The inverse of ``to_placement``; a placement cp never makes (a plain shard, a partial
    other than a sum) is refused."""
    if isinstance(p, tuple):
        return tuple(from_placement(x) for x in p)
    if isinstance(p, Shard) and p.seq_inner is not None and p.blocks is None:
        return Seq(p.dim, p.seq_inner, True)
    if isinstance(p, Replicate):
        return WHOLE if p.seq is None else Seq(p.seq[0], p.seq[1], False)
    if p == P:
        return PARTIAL
    raise ValueError(f"context parallelism has no placement {p}")
