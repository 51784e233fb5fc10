"""Context-parallel rules for the ops that compute: matmuls, embeddings, norms, reductions,
softmax, top-k, the loss and attention (the table and the preconditions: ``rules``)."""
from __future__ import annotations

import torch

from fxmegatron.passes.context_parallel.layout import is_split, seq, seq_at, seq_of
from fxmegatron.passes.context_parallel.registry import aligned_take, no_rule, register, summed
from fxmegatron.passes.tensor_parallel.nodes import arg, norm, packet, val
from fxmegatron.placement import P, R

aten = torch.ops.aten


def _batch_dim(view, node, x, out_dim_of, what):
    """The sequence of input ``x`` as a batch dim of the output (``out_dim_of(dim)``), or a
    refusal when the op contracts it."""
    s = view.placed(x)
    if not is_split(s):
        return None
    d = out_dim_of(seq_of(s)[0])
    if d is None:
        view.fail(node, f"contracts the sequence ({s} of {x.name}) in {what}")
    return seq_at(s, d)


@register(aten.linear)
def linear(view, node, split):
    """x·Wᵀ (+ b): the sequence is one of x's leading dims; W and b must not hold it."""
    x = node.args[0]
    nd = val(x).ndim
    s = _batch_dim(view, node, x, lambda d: d if d < nd - 1 else None, "a linear layer's input features")
    if any(view.split(a) for a in node.args[1:3] if a is not None):
        view.fail(node, "has a weight or bias split along the sequence")
    if s is None:
        return no_rule(view, node, split)
    return summed(view, node, s, "matmul.linear")


@register(aten.mm, aten.addmm, aten.bmm, aten.matmul, aten.baddbmm)
def matmul(view, node, split):
    """a·b: the sequence in a's rows (or a batch dim) with b whole, or in b's columns with a
    whole; never in the contracted dim."""
    pk = packet(node)
    a, b = node.args[1:3] if pk in (aten.addmm, aten.baddbmm) else node.args[:2]
    va, vb, out = val(a), val(b), val(node)
    sa, sb = view.placed(a), view.placed(b)
    split_a, split_b = is_split(sa), is_split(sb)
    if not (split_a or split_b):
        return no_rule(view, node, split)
    if split_a and split_b:
        view.fail(node, f"multiplies two tensors that both hold this rank's chunks ({sa}, {sb}): attention "
                        "written out as matmuls has no context-parallel form; use scaled_dot_product_attention")
    if split_a:
        s = _batch_dim(view, node, a, lambda d: d + out.ndim - va.ndim if d != va.ndim - 1 else None, "a·b")
    else:
        s = _batch_dim(view, node, b, lambda d: d + out.ndim - vb.ndim if d != vb.ndim - 2 or vb.ndim == 1
                       else None, "a·b")
        if vb.ndim >= 3 and seq_of(sb)[0] < vb.ndim - 2:
            view.fail(node, "has the sequence in a batch dim of its second operand")
    takes = ()
    if pk in (aten.addmm, aten.baddbmm) and isinstance(node.args[0], torch.fx.Node):
        takes = aligned_take(view, node.args[0], node, s, out)
    return summed(view, node, s, "matmul", takes)


@register(aten.embedding)
def embedding(view, node, split):
    """A lookup of this rank's ids: the ids' dims lead the output's."""
    s = view.placed(node.args[1])
    if is_split(s):
        return summed(view, node, s, "embedding")
    if split:
        view.fail(node, "looks up a table that holds this rank's chunks")
    return summed(view, node, s if seq_of(s) is not None else R, "embedding")


def _sequence_input(view, node):
    """The placement of ``node``'s first input when it holds a sequence, else None."""
    s = view.placed(node.args[0])
    return s if seq_of(s) is not None else None


@register(aten.layer_norm, aten.rms_norm)
def layer_norm(view, node, split):
    """Normalises the last len(normalized_shape) dims: the sequence must not be one of them."""
    s = _sequence_input(view, node)
    if s is None:
        return no_rule(view, node, split)
    nd = val(node.args[0]).ndim
    if seq_of(s)[0] >= nd - len(node.args[1]):
        if split:
            view.fail(node, f"normalises over the sequence ({s})")
        return summed(view, node, R, "norms")
    for a in node.args[2:4]:
        if isinstance(a, torch.fx.Node) and view.split(a):
            view.fail(node, "has a weight split along the sequence")
    return summed(view, node, s, "norms")


@register(aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax)
def softmax(view, node, split):
    """A softmax along another dim than the sequence."""
    s = _sequence_input(view, node)
    if s is None:
        return no_rule(view, node, split)
    if norm(node.args[1], val(node).ndim) == seq_of(s)[0]:
        if split:
            view.fail(node, f"is a softmax over the sequence ({s})")
        return summed(view, node, R, "softmax")
    return summed(view, node, s, "softmax")


@register(aten.topk)
def topk(view, node, split):
    """The k largest along another dim than the sequence (a router's experts per token): values
    and indices keep the sequence where the input has it."""
    s = _sequence_input(view, node)
    if s is None:
        return no_rule(view, node, split)
    if norm(arg(node, 2, "dim", -1), val(node.args[0]).ndim) == seq_of(s)[0]:
        if split:
            view.fail(node, f"ranks along the sequence ({s})")
        return summed(view, node, (R, R), "topk")
    return summed(view, node, (s, s), "topk")


_MEANS = {aten.mean}


@register(aten.sum, aten.mean, aten.amax, aten.amin)
def reduction(view, node, split):
    """A reduction over other dims keeps the sequence (shifted for dropped dims); a sum or
    mean over the sequence leaves each rank a partial sum (a mean's share divided by cp:
    every rank holds the same number of positions)."""
    s = _sequence_input(view, node)
    if s is None:
        return no_rule(view, node, split)
    nd = val(node.args[0]).ndim
    dims = arg(node, 1, "dim", None)
    dims = list(range(nd)) if dims is None or dims == [] else [norm(d, nd) for d in
                                                                 ([dims] if isinstance(dims, int) else dims)]
    keep = bool(arg(node, 2, "keepdim", False))
    sd = seq_of(s)[0]
    if sd in dims:
        if not split:
            return summed(view, node, R, "reductions")
        if packet(node) not in (aten.sum, aten.mean):
            view.fail(node, f"takes a {packet(node)} over the sequence ({s})")
        note = ("mean_divisor", view.cp) if packet(node) in _MEANS else None
        return summed(view, node, P, "reductions.partial", note=note)
    return summed(view, node, seq_at(s, sd if keep else sd - sum(1 for d in dims if d < sd)), "reductions")


@register(aten.cross_entropy_loss, aten.nll_loss)
def cross_entropy(view, node, split):
    """Over [N, V] logits with N the (flattened) sequence and targets taken alike. Mean
    (over counted targets) becomes this rank's sum over the count on all cp ranks; sum
    stays a partial sum; none keeps the sequence."""
    logits, target = node.args[:2]
    s = view.placed(logits)
    if not is_split(s):
        return no_rule(view, node, split)
    if val(logits).ndim != 2 or seq_of(s)[0] != 0:
        view.fail(node, f"is a loss over logits {tuple(val(logits).shape)} with the sequence at {s}: "
                        "context parallelism needs [tokens, classes]")
    takes = ()
    if not view.split(target):      # CE: target dim 0 is logits dim 0
        takes = aligned_take(view, target, node, seq(0, seq_of(s)[1]), val(target))
    reduction = arg(node, 3, "reduction", 1)
    if reduction == 0:
        return summed(view, node, s, "loss", takes)
    note = None
    if reduction == 1:
        if arg(node, 2, "weight", None) is not None:
            view.fail(node, "is a class-weighted mean: its divisor is a sum of weights, not a count")
        note = ("mean_loss", arg(node, 4, "ignore_index", -100))
    return summed(view, node, P, "loss.partial", takes, note)


@register(aten.scaled_dot_product_attention)
def attention(view, node, split):
    """Causal or full attention over q, k, v split along the sequence (dim -2); the keys and
    values of the other ranks come by ``cp_attention``."""
    q, k, v = node.args[:3]
    ps = [view.placed(a) for a in (q, k, v)]
    if not any(is_split(p) for p in ps):
        return no_rule(view, node, split)
    for a, p in zip((q, k, v), ps):
        nd = val(a).ndim
        if not (is_split(p) and seq_of(p) == (nd - 2, 1)):
            view.fail(node, f"reads {a.name} as {p}: context-parallel attention needs q, k and v split along "
                            "the sequence (dim -2)")
    mask = arg(node, 3, "attn_mask", None)
    if mask is not None:
        view.fail(node, f"has an attention mask ({mask.name}): context-parallel attention runs causal or full "
                        "attention only (a padding mask or a sliding window has no context-parallel form yet)")
    if arg(node, 4, "dropout_p", 0.0):
        view.fail(node, "has attention dropout")
    return summed(view, node, ps[0], "attention", note=("attention", None))
