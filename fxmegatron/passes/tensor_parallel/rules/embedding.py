"""Vocab-parallel embedding and cross-entropy (Megatron 2019, section 3)."""
from __future__ import annotations

import torch

from fxmegatron.errors import ShardingError
from fxmegatron.passes.tensor_parallel.nodes import arg, norm, val, where
from fxmegatron.passes.tensor_parallel.plan import Decision
from fxmegatron.passes.tensor_parallel.rules.opaque import replicate_all
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.placement import Partial, R, Shard

aten = torch.ops.aten


@register(aten.embedding)
def embedding(view, node):
    """``embedding(W, ids)`` as a vocab-parallel lookup (``embedding.vocab``): ``W`` split
    by rows, output a partial sum (each rank looks up the ids it owns).
    Precondition: ``W`` is a parameter that may be split, ``ids`` come from the batch
    (positions computed in the graph are looked up replicated), and neither
    ``scale_grad_by_freq`` nor ``sparse`` is set; otherwise replicated with the reason.
    ``padding_idx`` is carried: the rank holding the padding row zeroes its gradient
    (rewrite.py). tp must divide the vocabulary, else a ShardingError."""
    w, ids = node.args[0], node.args[1]
    pname = view.free[w][0] if w in view.free else None
    reason = None
    if pname is None:
        reason = "its table is not a parameter"
    elif pname in view.forced_rep:
        reason = view.forced_rep[pname]
    elif ids not in view.from_input:
        reason = "its indices are computed in the graph (e.g. positions), not read from the batch"
    elif arg(node, 3, "scale_grad_by_freq", False) or arg(node, 4, "sparse", False):
        flag = "scale_grad_by_freq" if arg(node, 3, "scale_grad_by_freq", False) else "sparse"
        reason = f"it is an embedding with {flag}=True (no vocab-parallel form)"
    if reason is None:
        vocab = val(w).shape[0]
        if vocab % view.tp:
            raise ShardingError(
                f"tp={view.tp} does not divide the vocabulary ({vocab} rows of {pname}) of the "
                f"embedding at {where(node)}: pad the vocabulary to a multiple of tp")
        view.claim(w, Shard(0), where(node))
        view.decide(Decision("vocab"))
        return view.set(node, Partial(), rule="embedding.vocab")
    view.claim(w, R, where(node))
    view.decide(Decision("replicated", reason))
    return view.set(node, R, rule="embedding.replicated")


@register(aten.cross_entropy_loss)
def cross_entropy(view, node):
    """A cross-entropy over logits split by class (the LM head's column split) runs
    vocab-parallel (``embedding.vocab_loss``). Precondition: 2-D logits split along dim 1
    without fused blocks, no class weights, no label smoothing; otherwise the LM head is
    demoted. Replicated logits: an ordinary, replicated loss."""
    logits, target = node.args[0], node.args[1]
    p = view.get(logits)
    if isinstance(p, Partial):
        view.replicate(logits, node)
        p = R
    if isinstance(p, Shard):
        nd = val(logits).ndim
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
        if nd != 2 or norm(p.dim, nd) != 1 or p.blocks is not None:
            view.demote(view.orig(logits), node, "is a cross-entropy over logits not split by class")
        if weight is not None or smoothing:
            view.demote(view.orig(logits), node,
                         "is a cross-entropy with class weights or label smoothing (no vocab-parallel form)")
        view.replicate(target, node)
        view.decide(Decision("vocab"))
        return view.set(node, R, rule="embedding.vocab_loss")
    return replicate_all(view, node, "")
