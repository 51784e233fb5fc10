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
* each rank's share of its logits row (V/t columns) is a multiple of ``ROW_ALIGN_BYTES`` bytes;

so the loss holds the only reference that survives the forward, and writing over it changes
no value anything else will read. The alignment is for ``compile=True`` on CUDA. There
inductor pads an unaligned vocabulary's matmul (``pad_mm``, on the joint graph) or buffer
(comprehensive padding), and it does so after AOT autograd has functionalized the in-place
backward. ``auto_functionalized_v2`` replays the view of the logits it recorded, as an
``as_strided`` with the unpadded strides, onto the padded buffer, and the kernel reads
misaligned rows. With HF GPT-2's vocabulary of 50257 the gradients were wrong on an H100
(norm 42023.9 against 1.58). ``tests/test_loss_grad_in_place.py`` reproduces this on CPU with
``pad_mm`` forced. An unaligned row keeps the out-of-place backward, which reads the logits
as they are. Autograd's version counter still guards a second backward
through the same graph (``retain_graph``): it raises instead of reading overwritten logits.

Where the compiled graph cannot hold that mutating call (inside the ``control_deps`` subgraphs
of inductor's overlap scheduler, ``lower/overlap_scheduler.py``), ``loss_grad_in_graph`` marks
every loss ``grad_in_graph`` instead: the backward as torch ops, which inductor fuses and may
write over the logits itself when they are a dead, donated buffer. No precondition: the ops
are functional, and whether to write in place is inductor's call on liveness.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.loss_upcast import CASTS
from fxmegatron.passes.views import is_view, under_views

aten = torch.ops.aten
ROW_ALIGN_BYTES = 128     # inductor's padding_alignment_bytes; pad_mm's alignment (16 bytes) divides it
_MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}


def _view_like(n: fx.Node) -> bool:
    """A view, or a cast to the dtype it already has (``logits.float()`` of fp32 logits)."""
    if is_view(n):
        return True
    if n.target in CASTS and isinstance(n.args[0], fx.Node):
        a, b = n.args[0].meta.get("val"), n.meta.get("val")
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.device == b.device
    return False


def _only_reader(loss: fx.Node) -> bool:
    x, _ = under_views(loss.args[0], _view_like)
    return (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _MATMULS
            and len(x.users) == 1 and not any(u.op == "output" for u in x.users))


def _aligned_rows(loss: fx.Node, tp: int) -> bool:
    """Each rank's share of the logits row is a multiple of ROW_ALIGN_BYTES bytes. The pass runs
    before ``check_local_shapes`` (compiler.py), so the node's value holds the whole row, of which
    each of the ``tp`` ranks holds an equal share (not equal: refused)."""
    v = loss.args[0].meta.get("val") if isinstance(loss.args[0], fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return False
    width, tp = v.shape[-1], max(tp, 1)
    return width % tp == 0 and width // tp * v.element_size() % ROW_ALIGN_BYTES == 0


def loss_grad_reuses_logits(gm: fx.GraphModule, tp: int = 1) -> int:
    """Mark every loss that meets the precondition (``reuse_logits=True``); returns how many.
    ``tp``: the tensor-parallel size (each rank's share of the row must be aligned too)."""
    done = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is vocab_parallel_cross_entropy and not n.kwargs.get("reuse_logits"):
            if len(n.args) <= 7 and _only_reader(n) and _aligned_rows(n, tp):
                n.kwargs = {**n.kwargs, "reuse_logits": True}
                done += 1
    return done


def loss_grad_in_graph(gm: fx.GraphModule) -> int:
    """Mark every loss ``grad_in_graph=True`` (the module doc says when); returns how many."""
    done = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is vocab_parallel_cross_entropy and not n.kwargs.get("grad_in_graph"):
            n.kwargs = {**n.kwargs, "grad_in_graph": True, "reuse_logits": False}
            done += 1
    return done
