"""Counter-based dropout: the mask of an element is a hash of (seed, step, site, global index).

Megatron keeps two RNG streams (one shared by the tp group, one per tp rank) so
that dropout outside tensor-parallel regions draws the same mask on every tp
rank and dropout inside them draws different ones. Keying each element's mask
by its index in the *unsplit* tensor gives both properties at once, and more:
the masks are those of the unsplit model, so results with dropout do not depend
on tp, sequence parallelism or recomputation.

* ``step`` advances once per forward call: a fresh ``key`` tensor is made at the
  top of the graph and flows into every dropout; a recomputed region receives
  it as an input (``torch.utils.checkpoint`` saves inputs), so recomputation
  replays the same masks with no RNG state to restore.
* ``site`` numbers the dropout calls of the graph in order.
* The hash is integer arithmetic on int64 tensors kept below 2**32, so that no
  product overflows: it gives the same bits on CPU and GPU.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .placement import Placement, Shard, shard_slices

_MASK = 0xFFFFFFFF


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (lowbias32 shape); multipliers < 2**31 keep int64 exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK
    return x ^ (x >> 16)


class DropoutRng(nn.Module):
    """Holds the seed and the step counter; one per transformed graph."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = int(seed)
        self.step = 0

    def next_key(self, device) -> Tensor:
        """The key for one forward call: (seed, step), then the step advances."""
        key = torch.tensor([self.seed & _MASK, self.step & _MASK], dtype=torch.int64, device=device)
        self.step += 1
        return key

    def extra_repr(self):
        return f"seed={self.seed}, step={self.step}"


def rng_key(rng: DropoutRng, like: Tensor) -> Tensor:
    """Graph node at the top of the forward: this call's key, on ``like``'s device."""
    return rng.next_key(like.device)


def local_layout(global_shape: Sequence[int], plc: Placement, rank: int, world: int) -> Tuple[int, tuple]:
    """(split dim or -1, ((start, length), ...) of it that ``rank`` holds): plain data for graph args."""
    if not isinstance(plc, Shard) or world == 1:
        return -1, ()
    d = plc.dim % len(global_shape)
    return d, tuple(shard_slices(global_shape[d], plc, rank, world))


def global_index(local_shape: Sequence[int], global_shape: Sequence[int], shard_dim: int, slices,
                 device) -> Tensor:
    """For each local element, its linear index in the unsplit tensor (int64)."""
    nd = len(global_shape)
    strides = [1] * nd
    for i in range(nd - 2, -1, -1):
        strides[i] = strides[i + 1] * global_shape[i + 1]
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for i in range(nd):
        if i == shard_dim:
            coord = torch.cat([torch.arange(s, s + n, device=device) for s, n in slices])
        else:
            coord = torch.arange(local_shape[i], device=device)
        view = [1] * nd
        view[i] = -1
        idx = idx + coord.view(view) * strides[i]
    return idx.expand(tuple(local_shape))


def keep_mask(key: Tensor, site: int, p: float, local_shape, global_shape, shard_dim: int = -1,
              slices=()) -> Tensor:
    """Boolean mask (True = keep) for the local piece of a dropout over ``global_shape``
    (``shard_dim``, ``slices``: see ``local_layout``)."""
    idx = global_index(local_shape, global_shape, shard_dim, slices, key.device)
    base = _mix((_mix(key[0] ^ 0x2545F491) + key[1] * 0x27D4EB2F + site * 0x165667B1) & _MASK)
    h = _mix((idx & _MASK) ^ base)
    if math.prod(global_shape) > _MASK:
        h = _mix(h ^ (idx >> 32))
    # top 24 bits -> uniform in [0, 1) with float32-exact steps
    u = (h >> 8).to(torch.float32) * (1.0 / (1 << 24))
    return u >= p


def counter_dropout(x: Tensor, p: float, train: bool, key: Tensor, site: int,
                    global_shape: Tuple[int, ...], shard_dim: int = -1, slices=()) -> Tensor:
    """``aten.dropout`` with a mask keyed by global element index (see module doc)."""
    if not train or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    keep = keep_mask(key, site, p, x.shape, global_shape, shard_dim, slices)
    # where() keeps the 1-byte mask for backward, not a float copy of it
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


def counter_dropout_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: float,
                              is_causal: bool, scale: Optional[float], enable_gqa: bool, key: Tensor,
                              site: int, global_shape: Tuple[int, ...], shard_dim: int = -1,
                              slices=()) -> Tensor:
    """Scaled dot-product attention whose dropout on the probabilities is ``counter_dropout``.

    Fused attention kernels draw their dropout mask from the device RNG, which no
    split of the heads can reproduce; with dropout > 0 attention therefore runs
    unfused (the math path, as PyTorch's own CPU path does with dropout).
    ``global_shape`` is the unsplit (batch, heads, q_len, kv_len) of the scores.
    """
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)
    if is_causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = F.softmax(scores, dim=-1)
    probs = counter_dropout(probs, p, True, key, site, global_shape, shard_dim, slices)
    return probs @ v
