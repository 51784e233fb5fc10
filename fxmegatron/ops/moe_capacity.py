"""The keep-mask of an MoE capacity factor (Megatron's ``moe_expert_capacity_factor`` with the
"probs" drop policy, without padding to capacity).

``moe_capacity_keep(ids, weights, num_experts, capacity)``: ``ids`` and ``weights`` are a
block's [T, k] top-k expert ids and routing weights; the result is [T, k] in ``weights``'
dtype, 1 where the (token, slot) assignment is kept and 0 where it is dropped. Expert e keeps
at most ``capacity`` of its assignments: those with the largest weights, ties broken by token
order (the earlier token first; one token picks an expert at most once).

It is one ``torch.library`` custom op so that the graph shows it as one node (the dump, the
passes); its body is torch ops. It has no gradient: the mask is a selection, and the caller
multiplies the weights by it, so a dropped pair's weight gets no gradient through the product.
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("fxmegatron::moe_capacity_keep", mutates_args=())
def moe_capacity_keep(ids: Tensor, weights: Tensor, num_experts: int, capacity: int) -> Tensor:
    flat_ids = ids.reshape(-1).to(torch.int64)
    flat_w = weights.detach().reshape(-1)
    n = flat_ids.numel()
    # two stable sorts: by weight (largest first, equal weights in token order), then by expert,
    # which keeps that order inside each expert's run
    by_w = torch.sort(flat_w, descending=True, stable=True).indices
    by_e = torch.sort(flat_ids[by_w], stable=True).indices
    order = by_w[by_e]
    counts = torch.bincount(flat_ids, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    # place of each sorted assignment inside its expert's run: 0 for the largest weight
    place = torch.arange(n, device=flat_ids.device) - starts[flat_ids[order]]
    keep = torch.empty(n, dtype=torch.bool, device=flat_ids.device)
    keep[order] = place < capacity
    return keep.to(weights.dtype).reshape(weights.shape)


@moe_capacity_keep.register_fake
def _(ids, weights, num_experts, capacity):
    return weights.new_empty(weights.shape)     # dense, as the body returns it, whatever weights' layout


def _setup(ctx, inputs, output):
    pass


def _backward(ctx, grad):
    return None, None, None, None


moe_capacity_keep.register_autograd(_backward, setup_context=_setup)

KEEP = torch.ops.fxmegatron.moe_capacity_keep.default     # the graph node's target
