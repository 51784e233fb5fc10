"""Let the fused cross-entropy write the logits' gradient over the logits.

The loss's backward makes a gradient the size of the logits ([N, V/t]: 1.5 GiB for gpt1.3b's
batch, 2 GiB for Llama-3.2-1B's) while the logits, saved for it, are still alive: two
logits-sized tensors at the peak. When nothing else reads the logits the gradient can take
their place, as inductor reuses the buffer of a pointwise kernel's dead input.

Precondition, checked per ``vocab_parallel_cross_entropy`` (a loss that does not meet it keeps
the out-of-place backward):
* its logits input is a matmul's output (``linear``, ``mm``, ``addmm``, ``matmul``, ``bmm``:
  ops whose backward saves their inputs, never their output), reached through view-like ops
  only (views, and casts to the dtype the tensor has), each used by the next alone, and none
  of them a graph output;
so the loss holds the only reference that survives the forward, and writing over it changes
no value anything else will read. Autograd's version counter still guards a second backward
through the same graph (``retain_graph``): it raises instead of reading overwritten logits.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.loss_upcast import CASTS, VIEWS

aten = torch.ops.aten
_MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}


def _view_like(n: fx.Node) -> bool:
    """A view, or a cast to the dtype it already has (``logits.float()`` of fp32 logits)."""
    if n.target in VIEWS:
        return True
    if n.target in CASTS and isinstance(n.args[0], fx.Node):
        a, b = n.args[0].meta.get("val"), n.meta.get("val")
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.device == b.device
    return False


def _only_reader(loss: fx.Node) -> bool:
    x = loss.args[0]
    while isinstance(x, fx.Node) and x.op == "call_function" and _view_like(x):
        if len(x.users) != 1:
            return False
        x = x.args[0]
    return (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _MATMULS
            and len(x.users) == 1 and not any(u.op == "output" for u in x.users))


def loss_grad_reuses_logits(gm: fx.GraphModule) -> int:
    """Mark every loss that meets the precondition (``reuse_logits=True``); returns how many."""
    done = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is vocab_parallel_cross_entropy and not n.kwargs.get("reuse_logits"):
            if len(n.args) <= 7 and _only_reader(n):
                n.kwargs = {**n.kwargs, "reuse_logits": True}
                done += 1
    return done
