"""Whether a constant attention mask is causal, proven without materialising it.

A traced model's mask (``attention_rewrites.causal_mask``'s precondition: computed from no
input, parameter, buffer or random op) is [.., Q, K], built by broadcasting: small tensors
that vary along the queries ([.., Q, 1], a "row") or along the keys ([.., 1, K], a "column")
are compared and combined elementwise. HF's masks are ``key_pos <= query_pos`` and, for packed
sequences, ``seq_id[q] == seq_id[k]``, joined with ``&``. At 128k tokens the whole mask holds
2^34 entries per batch row: evaluated, it took most of a layout's build (issue: 112-125 s on
the device at 128k).

Here each large (Q·K-sized) boolean of the mask's graph is held as, for every leading index
and query q, an interval [lo, hi) of the keys it holds true. The precondition, checked op by
op, keeps that exact:

* a comparison (<, <=, >, >=, ==) of a row with a column whose values never decrease along the
  keys is an interval per query (``searchsorted``), and so is its comparison the other way;
* ``&`` of two intervals is their intersection (an empty one stays empty);
* a cast to bool, an all-true scalar (``new_ones``) and a broadcasting ``expand`` keep it.

Anything else (another op on a large value, a column that decreases, a float mask) is not
proven here: ``None``, and the caller evaluates the mask as before where it is small enough.
The mask is causal iff every query q holds exactly [0, q + 1) with as many queries as keys.
Every other value (a row, a column, an index: not query × key) is evaluated exactly, on the
CPU, up to ``SMALL`` elements.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.fx as fx

aten = torch.ops.aten
SMALL = 1 << 24

_COMPARE = {aten.le.Tensor: "le", aten.lt.Tensor: "lt", aten.ge.Tensor: "ge", aten.gt.Tensor: "gt",
            aten.eq.Tensor: "eq"}
_FLIP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}     # a OP b  ==  b FLIP[OP] a
_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}
_EXPAND = {aten.expand.default}


class Intervals:
    """For each leading index (broadcast shape ``lead``) and query: keys [lo, hi) are true."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, k_len: int):
        self.lo, self.hi, self.k_len = lo, hi, k_len

    def dense(self) -> np.ndarray:
        """The boolean [..lead, Q, K] they describe (for tests: the mask itself, small)."""
        k = np.arange(self.k_len)
        return (self.lo[..., None] <= k) & (k < self.hi[..., None])

    def fit(self, rank: int) -> "Intervals":
        """The same intervals with leading axes of size 1 up to ``rank`` dims ([..lead, Q]), so
        that the leading dims line up with the value's as numpy broadcasts them."""
        more = rank - self.lo.ndim
        if more <= 0:
            return self
        shape = (1,) * more
        return Intervals(self.lo.reshape(shape + self.lo.shape), self.hi.reshape(shape + self.hi.shape), self.k_len)

    def __and__(self, other: "Intervals") -> "Intervals":
        lo, hi = np.broadcast_arrays(np.maximum(self.lo, other.lo), np.minimum(self.hi, other.hi))
        lo = lo.copy()
        hi = np.maximum(hi, lo)
        return Intervals(lo, hi, self.k_len)


def _evaluate_small(node: fx.Node, env: Dict[fx.Node, object]) -> Optional[torch.Tensor]:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
    if "device" in kwargs:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    return node.target(*args, **kwargs)


def _row_or_column(t: torch.Tensor, q_len: int, k_len: int) -> Optional[Tuple[str, np.ndarray]]:
    """("row", values [..lead, Q]) for a [.., Q, 1] tensor, ("col", [..lead, K]) for [.., 1, K]."""
    if t.dim() < 2 or t.is_complex():
        return None
    if t.shape[-1] == 1 and t.shape[-2] in (q_len, 1) and not (t.shape[-2] == 1 and k_len == 1):
        return "row", t[..., 0].numpy()
    if t.shape[-2] == 1 and t.shape[-1] in (k_len, 1):
        return "col", t[..., 0, :].numpy()
    return None


def _compare(op: str, row: np.ndarray, col: np.ndarray, k_len: int) -> Optional[Intervals]:
    """{k : row[q] OP col[k]} for every leading index and query, when ``col`` never decreases
    along the keys (else None). ``row`` [..lead, Q], ``col`` [..lead, K]."""
    if col.shape[-1] == 1:
        col = np.broadcast_to(col, col.shape[:-1] + (k_len,))
    if col.shape[-1] > 1 and (np.diff(col, axis=-1) < 0).any():
        return None
    lead = np.broadcast_shapes(row.shape[:-1], col.shape[:-1])
    rows = np.broadcast_to(row, lead + row.shape[-1:])
    cols = np.broadcast_to(col, lead + col.shape[-1:])
    lo = np.zeros(rows.shape, dtype=np.int64)
    hi = np.full(rows.shape, k_len, dtype=np.int64)
    for idx in np.ndindex(*lead):
        c, r = cols[idx], rows[idx]
        left, right = np.searchsorted(c, r, "left"), np.searchsorted(c, r, "right")
        if op == "le":      # r <= c[k]: keys from the first c >= r
            lo[idx] = left
        elif op == "lt":
            lo[idx] = right
        elif op == "ge":    # r >= c[k]: keys up to the last c <= r
            hi[idx] = right
        elif op == "gt":
            hi[idx] = left
        else:
            lo[idx], hi[idx] = left, right
    return Intervals(lo, hi, k_len)


def _step(node: fx.Node, env: Dict[fx.Node, object], q_len: int, k_len: int) -> Optional[object]:
    """The node's value: a small tensor, an ``Intervals``, or None (not provable here)."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor):
        return None
    if val.dim() < 2 or tuple(val.shape[-2:]) != (q_len, k_len) or q_len * k_len == 1:
        # not query × key: a row, a column or a smaller value, evaluated exactly
        if val.numel() > SMALL or any(isinstance(env[a], Intervals) for a in node.all_input_nodes):
            return None
        return _evaluate_small(node, env)
    if node.target in _COMPARE and len(node.args) == 2:
        a, b = (env[x] if isinstance(x, fx.Node) else None for x in node.args)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        fa, fb = _row_or_column(a, q_len, k_len), _row_or_column(b, q_len, k_len)
        if fa is None or fb is None or {fa[0], fb[0]} != {"row", "col"}:
            return None
        op = _COMPARE[node.target]
        if fa[0] == "col":
            op, fa, fb = _FLIP[op], fb, fa
        return _compare(op, fa[1], fb[1], k_len)
    if node.target in _AND and len(node.args) == 2:
        a, b = (env.get(x) if isinstance(x, fx.Node) else x for x in node.args)
        a, b = (_all_true(x, k_len) for x in (a, b))
        if isinstance(a, Intervals) and isinstance(b, Intervals):
            return a & b
        return None
    if node.target in _CASTS or node.target in _EXPAND:
        src = env[node.args[0]]
        if isinstance(src, Intervals) and val.dtype == torch.bool:     # bool to bool, or a broadcast
            return src
    if node.target is aten.unsqueeze.default:
        src, dim = env[node.args[0]], node.args[1] % val.dim()
        if isinstance(src, Intervals) and dim < val.dim() - 2:         # a new leading dim
            src = src.fit(val.dim() - 1)
            return Intervals(np.expand_dims(src.lo, dim), np.expand_dims(src.hi, dim), k_len)
    return None


def _all_true(x, k_len: int):
    """An all-true boolean scalar (HF's ``new_ones([])`` start) as the interval of every key."""
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.numel() == 1 and bool(x.item()):
        return Intervals(np.zeros((1,), dtype=np.int64), np.full((1,), k_len, dtype=np.int64), k_len)
    return x


def key_intervals(mask: fx.Node, ancestors, q_len: int, k_len: int) -> Optional[Intervals]:
    """``mask`` (computed from ``ancestors``, in graph order) as key intervals, or None where
    the module's rules do not hold."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return None
    env: Dict[fx.Node, object] = {}
    for n in ancestors:
        out = _step(n, env, q_len, k_len)
        if out is None:
            return None
        env[n] = out.fit(n.meta["val"].dim() - 1) if isinstance(out, Intervals) else out
    got = env[mask]
    return got if isinstance(got, Intervals) else None


def proven_causal(mask: fx.Node, ancestors, q_len: int, k_len: int) -> Optional[bool]:
    """True/False when the intervals decide whether ``mask`` (with ``ancestors``, in graph
    order) is the causal mask; None when they cannot (the caller may evaluate it)."""
    got = key_intervals(mask, ancestors, q_len, k_len) if q_len == k_len else None
    if got is None:
        return None
    q = np.arange(q_len, dtype=np.int64)
    empty = got.lo >= got.hi
    causal_rows = (got.lo == 0) & (got.hi == q + 1) & ~empty
    return bool(causal_rows.all())
