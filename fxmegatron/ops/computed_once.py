"""``fxmegatron::computed_once``: the identity, as an op inductor cannot see through.

Under ``torch.compile`` inductor inlines a cheap elementwise producer into every consumer, and
AOTAutograd's partitioner recomputes such a producer in the backward rather than save it. For a
rotary table (cos and sin of position × inverse frequency) read by every layer that means the
sines and cosines are evaluated again per element of q and k, forward and backward, in every
layer. Behind this op the table is one buffer, computed once and read by all
(``passes/tables_once.py`` places it). Its backward passes the gradient through.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("fxmegatron::computed_once", mutates_args=())
def computed_once(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@computed_once.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad


computed_once.register_autograd(_backward)
