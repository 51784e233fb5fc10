"""Two rewrites of ``scaled_dot_product_attention`` that keep its value and drop work.

Captured HF models hand SDPA what their eager forward built for it: a boolean mask
materialised from ``arange`` comparisons (tracing makes HF keep the mask it would skip in
eager mode), and keys and values with their kv heads repeated to the query heads
(``repeat_kv``). SDPA then takes a general masked kernel and reads copied kv heads; on an
H100 at Llama-3.2-1B's shapes that is about twice the attention time of the causal kernel
with grouped heads (docs/history/PERFORMANCE-2026-11-26.md). Both rewrites hold whatever the tensor-parallel
split, so they run on the rank's graph.

``causal_mask`` — precondition: the mask is computed from no graph input, no parameter or
buffer and no random op (so it is one constant for the traced shapes); evaluated here, on
the CPU, it is exactly "query i sees key j iff j <= i" for every batch row and head (a bool
mask, or a float mask of 0 and -inf), with as many queries as keys. Then
``attn_mask=..., is_causal=False`` becomes ``attn_mask=None, is_causal=True``: the same
function, proven on the values. The proof holds each query's keys as an interval
(``mask_intervals``: no query × key tensor, so its cost does not grow with the sequence
squared); a mask built otherwise is evaluated whole, up to ``MAX_MASK_ELEMENTS`` (past 128k
tokens it is not evaluated and stays).

``grouped_kv`` — precondition: keys and values are each ``reshape(expand(unsqueeze(x, 2),
[B, Hkv, r, S, D]), [B, Hkv·r, S, D])`` of a [B, Hkv, S, D] tensor with the same r, the
query has Hkv·r heads, no dropout, and any mask is broadcast over heads. Then SDPA reads x
with ``enable_gqa=True``, which gives query head h the kv head h // r: what the copies held.
"""
from __future__ import annotations

from typing import List, Optional, Set

import torch
import torch.fx as fx

from fxmegatron.passes.mask_intervals import proven_causal

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
MAX_MASK_ELEMENTS = 1 << 34      # a 128k-token mask: 16 GiB of bools, evaluated once
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_arg(n: fx.Node, name: str):
    """SDPA's argument ``name`` at node ``n``, given by position or keyword or left at its default."""
    i = _ARGS.index(name) if name in _ARGS else None
    if i is not None and i < len(n.args):
        return n.args[i]
    return n.kwargs.get(name, _DEFAULTS.get(name))


def _set(n: fx.Node, **values) -> None:
    """Rewrite SDPA's arguments as keywords past the three tensors (the same call), leaving out
    those at their defaults."""
    kw = {k: sdpa_arg(n, k) for k in _DEFAULTS}
    kw.update(values)
    n.args = tuple(n.args[:3])
    n.kwargs = {k: v for k, v in kw.items() if (v is not None if _DEFAULTS[k] is None else v != _DEFAULTS[k])}


def _ancestors(node: fx.Node) -> List[fx.Node]:
    seen: Set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _constant_ancestors(mask: fx.Node) -> Optional[List[fx.Node]]:
    """The nodes the mask is computed from, in graph order, when it is a constant of the traced
    shapes (module docstring: no input, parameter, buffer or random op), else None."""
    if not isinstance(mask.meta.get("val"), torch.Tensor):
        return None
    nodes = _ancestors(mask)
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
    return nodes


def _is_causal_mask(mask: fx.Node, q_len: int, k_len: int) -> bool:
    """The precondition, then the proof: by key intervals (``mask_intervals``: no Q·K tensor,
    any length), else by evaluating the mask where it has at most ``MAX_MASK_ELEMENTS``."""
    nodes = _constant_ancestors(mask)
    if nodes is None:
        return False
    proven = proven_causal(mask, nodes, q_len, k_len)
    if proven is not None:
        return proven
    value = _constant_value(mask, nodes)
    return value is not None and is_causal_value(value, q_len, k_len)


def _constant_value(mask: fx.Node, nodes: List[fx.Node]) -> Optional[torch.Tensor]:
    """The mask's value, evaluated on the CPU from its constant ancestors ``nodes``; None past
    ``MAX_MASK_ELEMENTS``."""
    if mask.meta["val"].numel() > MAX_MASK_ELEMENTS:
        return None
    env = {}
    for n in nodes:          # on the CPU, whatever device the graph was traced for
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        env[n] = n.target(*args, **kwargs)
    return env[mask]


def is_causal_value(m: torch.Tensor, q_len: int, k_len: int, rows: int = 4096) -> bool:
    """Whether ``m`` is the causal mask, checked in blocks of ``rows`` queries (a 128k-token
    mask holds 2^34 entries: no whole-size reference beside it)."""
    if m.dim() < 2 or q_len != k_len or tuple(m.shape[-2:]) != (q_len, k_len):
        return False
    if m.dtype != torch.bool and not m.is_floating_point():
        return False
    keys = torch.arange(k_len)
    for i in range(0, q_len, rows):
        block = m[..., i:i + rows, :]
        tril = keys[None, :] <= torch.arange(i, i + block.shape[-2])[:, None]
        if m.dtype == torch.bool:
            ok = bool((block == tril).all())
        else:
            ok = bool(((block == 0) == tril).all() and torch.isneginf(block[..., ~tril]).all())
        if not ok:
            return False
    return True


def causal_mask(gm: fx.GraphModule) -> int:
    """Apply the ``causal_mask`` rewrite where its precondition holds; returns how many."""
    done = 0
    verdicts = {}     # one mask serves every layer: evaluate it once
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not SDPA:
            continue
        mask = sdpa_arg(n, "attn_mask")
        if not isinstance(mask, fx.Node) or sdpa_arg(n, "is_causal"):
            continue
        q, k = n.args[0].meta.get("val"), n.args[1].meta.get("val")
        if q is None or k is None:
            continue
        key = (mask, q.shape[-2], k.shape[-2])
        if key not in verdicts:
            verdicts[key] = _is_causal_mask(mask, q.shape[-2], k.shape[-2])
        if not verdicts[key]:
            continue
        _set(n, attn_mask=None, is_causal=True)
        _erase_dead(mask)
        done += 1
    return done


def _erase_dead(node: fx.Node) -> None:
    """Erase ``node`` if nothing uses it, then its inputs that this leaves unused (inputs,
    parameters and impure ops stay)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function" or n.is_impure() or getattr(n, "_erased", False):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def _repeated_kv(n: fx.Node):
    """(x, r) when ``n`` is repeat_kv of x (module docstring), else None."""
    if not (isinstance(n, fx.Node) and n.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default)):
        return None
    ex = n.args[0]
    if not (isinstance(ex, fx.Node) and ex.target is aten.expand.default):
        return None
    un = ex.args[0]
    if not (isinstance(un, fx.Node) and un.target is aten.unsqueeze.default and un.args[1] == 2):
        return None
    x = un.args[0]
    xv, ev, nv = x.meta.get("val"), ex.meta.get("val"), n.meta.get("val")
    if xv is None or ev is None or nv is None or xv.dim() != 4 or ev.dim() != 5:
        return None
    b, hkv, s, d = xv.shape
    r = ev.shape[2]
    if tuple(ev.shape) != (b, hkv, r, s, d) or tuple(nv.shape) != (b, hkv * r, s, d):
        return None
    return x, r


def grouped_kv(gm: fx.GraphModule) -> int:
    """Apply the ``grouped_kv`` rewrite where its precondition holds; returns how many."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not SDPA or sdpa_arg(n, "enable_gqa"):
            continue
        k, v = _repeated_kv(n.args[1]), _repeated_kv(n.args[2])
        if k is None or v is None or k[1] != v[1] or k[1] == 1:
            continue
        q = n.args[0].meta.get("val")
        mask = sdpa_arg(n, "attn_mask")
        mval = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if q is None or q.shape[1] != k[0].meta["val"].shape[1] * k[1] or sdpa_arg(n, "dropout_p") != 0.0:
            continue
        if mask is not None and (mval is None or mval.dim() == 4 and mval.shape[1] != 1):
            continue
        old_k, old_v = n.args[1], n.args[2]
        n.args = (n.args[0], k[0], v[0]) + tuple(n.args[3:])
        _set(n, enable_gqa=True)
        _erase_dead(old_k)
        _erase_dead(old_v)
        done += 1
    return done


def attention_rewrites(gm: fx.GraphModule) -> int:
    """Both rewrites, the mask first (a grouped SDPA keeps a mask only if it is broadcast over
    heads); returns how many SDPA calls changed."""
    return causal_mask(gm) + grouped_kv(gm)

