"""Vocab-parallel embedding and cross-entropy (Megatron 2019, section 3).

Both take the rank's slice of the vocabulary ``[vocab_start, vocab_start + V/t)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fxmegatron.ops.collectives import all_reduce_max, reduce_from_tp
from fxmegatron.ops.registry import register


def vocab_parallel_embedding(weight: Tensor, ids: Tensor, vocab_start: int,
                             padding_idx: Optional[int] = None) -> Tensor:
    """Look up the ids this rank owns; zeros elsewhere. The result is a partial
    sum over ranks: the graph reduces it with ``reduce_from_tp`` (g).

    ``padding_idx``: ATen's, as an index into this rank's slice, on the rank that holds
    the padding row (None on the others): the forward is unchanged and that row's
    gradient stays zero."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight, padding_idx=padding_idx)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, vocab_start: int,
                                 group_name: str, reduction: int = 1,
                                 ignore_index: int = -100, out_dtype: Optional[torch.dtype] = None,
                                 reuse_logits: bool = False, grad_in_graph: bool = False) -> Tensor:
    """Cross-entropy over logits split along the class (last) dim.

    Three all-reduces of ``N`` numbers instead of gathering ``N x V`` logits:
    the max (for stability), the sum of exponentials and the target's logit.
    ``reduction`` follows ATen: 0 none, 1 mean over non-ignored targets, 2 sum.
    ``out_dtype``: the loss's dtype (default the logits'); ``passes.loss_upcast`` sets float32
    where the model upcast its logits only to compute this loss. ``reuse_logits``: nothing else
    reads the logits (``passes.loss_grad_in_place`` proved it), so the fused kernel's backward
    may write their gradient over them. ``grad_in_graph``: the fused kernel's backward as torch
    ops in the compiled graph instead, which inductor may write over the logits itself
    (``kernels/cross_entropy.py`` says where).
    """
    out_dtype = out_dtype or logits.dtype
    from fxmegatron.codegen.where_kernels_run import kernels_in_compiled_graph, kernels_run
    # a real GPU tensor, the interpreter, or torch.compile tracing for either (the op stays a call)
    compiled = kernels_in_compiled_graph(logits)
    if compiled or kernels_run(logits):
        from fxmegatron.kernels.cross_entropy import fused_vocab_cross_entropy
        loss = fused_vocab_cross_entropy(logits, target, vocab_start, group_name, ignore_index, reuse_logits,
                                         grad_in_graph and compiled)
        return _reduce(loss, target != ignore_index, reduction, out_dtype)
    logits = logits.float()    # softmax statistics in fp32 whatever the model's dtype, as Megatron does
    shift = all_reduce_max(logits.detach().amax(-1), group_name)
    z = logits - shift.unsqueeze(-1)
    sum_exp = reduce_from_tp(z.exp().sum(-1), group_name)
    local = target - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = z.gather(-1, local.masked_fill(~inside, 0).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tp(picked.masked_fill(~inside, 0.0), group_name)
    valid = target != ignore_index
    loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
    return _reduce(loss, valid, reduction, out_dtype)


register(vocab_parallel_cross_entropy, "vocab_parallel_cross_entropy",
         "all-reduce(max) of each row's maximum, all-reduce(sum) of its exponentials' sum and of its target's "
         "logit (forward); no communication backward", (3,), steps=("max", "g", "g"))


def _reduce(loss: Tensor, valid: Tensor, reduction: int, out_dtype) -> Tensor:
    if reduction == 0:
        return loss.to(out_dtype)
    if reduction == 2:
        return loss.sum().to(out_dtype)
    count = valid.sum().to(loss.dtype)
    # no counted label (a microbatch whose answers were all cut away): the mean is 0/0, NaN as
    # ATen's, but its gradient must be 0 for the step that weights this microbatch 0, not the
    # division's 0/0 (which the fused kernel's backward would carry into every row)
    return torch.where(count > 0, loss.sum() / count.clamp_min(1), torch.nan).to(out_dtype)
