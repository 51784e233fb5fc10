"""Counter-based dropout: the mask of an element is Philox of (seed, step, site, global index).

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
* The random bits are Triton's Philox 4x32-10 (``tl.randint4x(seed, offset)``): key
  (k0, k1) = (mixed seed + site, step); element g takes word g % 4 at counter g // 4
  of its global index g, so one Philox call serves four elements.
  Generated kernels call ``tl.randint4x`` itself and regenerate the mask in backward;
  ``philox_uniform`` below is the same function in int64 torch ops (every product
  split so that nothing overflows), so fused and unfused dropout draw the same
  mask bit for bit, on CPU and GPU.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fxmegatron.codegen.chain_source import FULL, KEY
from fxmegatron.codegen.expr import dropout_chain
from fxmegatron.codegen.fused_chain import FusedChain
from fxmegatron.codegen.where_kernels_run import kernels_run
from fxmegatron.placement import Placement, Shard, shard_slices

_MASK = 0xFFFFFFFF


def _mix(x: int) -> int:
    """A 32-bit integer finaliser (lowbias32): spreads a small seed over the key's bits."""
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_UNIFORM_SCALE = 4.6566127342e-10      # triton.language.random.uint_to_uniform_float, 32-bit


def _mulhilo(a: int, b: Tensor) -> Tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * b for a constant a < 2**32 and b in [0, 2**32), in int64
    without overflow: b is split in 16-bit halves so every partial product is < 2**49."""
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox_uniform(k0: Tensor, k1: Tensor, index: Tensor) -> Tensor:
    """Uniform float32 in [0, 1) for each element ``index`` (int64 >= 0): word ``index % 4`` of
    Philox 4x32-10 with key (k0, k1) and counter (low word, high word, 0, 0) of ``index // 4``,
    mapped to a float as ``tl.rand`` does. It is ``tl.randint4x(seed, index // 4)``, which
    generated kernels call once per four elements."""
    counter = index >> 2
    c0, c1 = counter & _MASK, counter >> 32
    c2 = c3 = torch.zeros((), dtype=torch.int64, device=counter.device)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mulhilo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _MASK, (k1 + _PHILOX_KEY[1]) & _MASK
    w = index & 3
    word = torch.where(w == 0, c0, torch.where(w == 1, c1, torch.where(w == 2, c2, c3)))
    x = torch.where(word >= 2 ** 31, word - 2 ** 32, word)          # the int32 view of the word
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)


def philox_key(key: Tensor, site: int) -> Tuple[Tensor, Tensor]:
    """Philox key words of a dropout site: ((mixed seed + site) mod 2**32, step mod 2**32)."""
    return (key[0] + site) & _MASK, key[1] & _MASK


class DropoutRng(nn.Module):
    """Holds the seed and the step counter; one per transformed graph."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = int(seed)
        self.step = 0

    def next_key(self, device) -> Tensor:
        """The key for one forward call: (mixed seed, step), then the step advances. In eval mode
        (``module.eval()``) the key has a third word and dropout is off: the step stays."""
        if not self.training:
            return torch.zeros(3, dtype=torch.int64, device=device)
        key = torch.tensor([_mix(self.seed ^ 0x2545F491), self.step & _MASK], dtype=torch.int64, device=device)
        self.step += 1
        return key

    def extra_repr(self):
        return f"seed={self.seed}, step={self.step}"


def dropout_off(key: Tensor) -> bool:
    """Whether ``key`` is an eval-mode key: its length is static, so this is no device sync and
    torch.compile guards on it."""
    return key.shape[0] == 3


def rng_key(rng: DropoutRng, like: Tensor) -> Tensor:
    """Graph node at the top of the forward: this call's key, on ``like``'s device. A forward
    on fake or meta tensors (shape propagation, planning) is analysis, not a step: the
    counter stays, so no pass has to put it back."""
    if is_fake(like) or like.device.type == "meta":
        return torch.zeros(2, dtype=torch.int64, device=like.device)
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
    k0, k1 = philox_key(key, site)
    return philox_uniform(k0, k1, idx) >= torch.tensor(p, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _dropout_kernel(p, site, global_shape, shard_dim, slices):
    """On GPUs: the same dropout as one generated Triton kernel (``tl.randint4x``, the mask drawn
    again in backward) instead of Philox's ~250 int64 torch ops.

    One per (p, site, layout), kept for the life of the process: a model has a bounded set of
    dropout sites, and the ``FusedChain`` keeps the launch plans its calls work out."""
    start = slices[0][0] if slices else 0
    return FusedChain(dropout_chain(p, site, global_shape, shard_dim if slices else -1, start), [FULL, KEY])


def counter_dropout(x: Tensor, p: float, train: bool, key: Tensor, site: int,
                    global_shape: Tuple[int, ...], shard_dim: int = -1, slices=()) -> Tensor:
    """``aten.dropout`` with a mask keyed by global element index (see module doc)."""
    if not train or p == 0.0 or dropout_off(key):
        return x
    if p >= 1.0:
        return x * 0.0
    # GPUs only: under the CPU interpreter the torch form is faster and draws the same bits
    if kernels_run(x, interpreter=False) and len(slices) <= 1 and math.prod(global_shape) < 2 ** 32:
        return _dropout_kernel(p, site, tuple(global_shape), shard_dim, tuple(slices)).apply(x, key)
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
    if dropout_off(key):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
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
