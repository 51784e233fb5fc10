"""Let the loss read the logits in their own dtype instead of an fp32 copy of them.

Models upcast their logits to fp32 before cross-entropy (Hugging Face's ``ForCausalLMLoss``
does ``logits.float()``). Run as written, that writes an fp32 copy of the [N, V] logits
(4 GiB at 8192 tokens and a 128k vocabulary), reads it back in the loss, writes the
gradient in fp32 and casts it down again: two extra passes over the largest tensor of the
step, and the largest activation kept. The loss (``vocab_parallel_cross_entropy``, fused
or not) computes its softmax statistics in fp32 whatever it reads, so it can take the
uncast logits and be told to return the cast's dtype.

Precondition, checked per loss (a loss that does not meet it is left as it is):
* its logits input is an ``aten.to`` / ``_to_copy`` to float32 followed only by view-like ops
  (``view``, ``reshape``, ``_unsafe_view``), each used by the next alone;
* the cast's input is a lower-precision float (bf16, fp16), so the upcast is exact.
Then the loss sees the same fp32 numbers and the logits' gradient is rounded to their dtype
once, as the cast's backward did. Bit for bit on the CPU (where the tests run the kernels in
Triton's interpreter); on a GPU the fused kernel's sums over the vocabulary follow the vector
width of what it loads, so reading bf16 instead of fp32 sums in another order: the loss
moves within fp32 rounding (1e-7 relative, seen on an H100), gradients within bf16's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.views import under_views

aten = torch.ops.aten
CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
_NARROW = {torch.bfloat16, torch.float16}
OUT_DTYPE = 6      # vocab_parallel_cross_entropy's out_dtype argument


def _cast_dtype(n: fx.Node):
    if n.target is aten.to.dtype:
        return n.args[1] if len(n.args) > 1 else n.kwargs.get("dtype")
    if len(n.args) > 1:      # a to/_to_copy with more than the dtype: leave it
        return None
    return n.kwargs.get("dtype")


def _upcast_before(loss: fx.Node):
    """(cast node, views from the cast to the loss) when ``loss`` meets the precondition."""
    x, views = under_views(loss.args[0])
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in CASTS and len(x.users) == 1):
        return None
    src = x.args[0]
    src_val = src.meta.get("val") if isinstance(src, fx.Node) else None
    if _cast_dtype(x) is not torch.float32 or not isinstance(src_val, torch.Tensor) or src_val.dtype not in _NARROW:
        return None
    return x, views[::-1]


def loss_reads_logits_dtype(gm: fx.GraphModule) -> int:
    """Apply the rewrite to every loss that meets the precondition; returns how many did."""
    done = 0
    for loss in list(gm.graph.nodes):
        if loss.op != "call_function" or loss.target is not vocab_parallel_cross_entropy:
            continue
        if len(loss.args) > OUT_DTYPE or "out_dtype" in loss.kwargs:
            continue
        found = _upcast_before(loss)
        if found is None:
            continue
        cast, views = found
        src = cast.args[0]
        narrow = src.meta["val"].dtype
        (views[0] if views else loss).replace_input_with(cast, src)
        for v in views:          # the same views, now of the narrow tensor
            v.meta["val"] = v.meta["val"].to(narrow)
        gm.graph.erase_node(cast)
        loss.kwargs = {**loss.kwargs, "out_dtype": torch.float32}
        done += 1
    return done
