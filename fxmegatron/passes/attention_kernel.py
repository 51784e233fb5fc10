"""``scaled_dot_product_attention`` → ``fxmegatron::attention`` on CUDA, where the op's value is
the same and its backward is fxmegatron's own (``ops/fused_attention.py``): aten's cuDNN
backward can replay a graph another model in the process built for another grad-output layout,
and then the gradients are wrong with no error (``ops/own_thread.py``).

Precondition per node: no mask, no dropout, q/k/v 4-D in fp16 or bf16 with a head dim the
fused kernels take (a multiple of 8, at most 256; otherwise the op would fall back to math),
k and v with the same heads, q's heads a multiple of theirs (grouped heads read as
``enable_gqa`` does, which SDPA would otherwise refuse unless the heads are equal), and with
``is_causal`` as many queries as keys (SDPA's causal mask is top-left aligned, as the op's is).
Other SDPA nodes stay (a masked one or one with dropout: docs/TRAINING.md names the case). The
pass runs on CUDA ranks only, last, so every other pass and the dumps see SDPA.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxmegatron.ops.attention_blocks import kernels_take
from fxmegatron.ops.fused_attention import attention
from fxmegatron.passes.attention_rewrites import SDPA, sdpa_arg


def _eligible(n: fx.Node) -> bool:
    if sdpa_arg(n, "attn_mask") is not None or sdpa_arg(n, "dropout_p") != 0.0:
        return False
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in n.args[:3]]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 or not kernels_take(t) for t in vals):
        return False
    q, k, v = vals
    grouped_ok = q.shape[1] == k.shape[1] or sdpa_arg(n, "enable_gqa")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] or not grouped_ok:
        return False
    return not (sdpa_arg(n, "is_causal") and q.shape[2] != k.shape[2])


def _rewrite(gm: fx.GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not SDPA or not _eligible(n):
            continue
        with gm.graph.inserting_before(n):
            call = gm.graph.call_function(attention, (*n.args[:3], bool(sdpa_arg(n, "is_causal")),
                                                      sdpa_arg(n, "scale")))
            call.meta = dict(n.meta)
            q = n.args[0].meta["val"]
            call.meta["val"] = (n.meta["val"], q.new_empty(q.shape[:-1], dtype=torch.float32))
        with gm.graph.inserting_after(call):
            out = gm.graph.call_function(operator.getitem, (call, 0))
            out.meta = dict(n.meta)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count


def fused_attention_kernel(gm: fx.GraphModule) -> fx.GraphModule:
    """Every eligible SDPA node of ``gm`` and of its graph submodules (recompute's regions)
    replaced by ``fxmegatron::attention``'s output 0."""
    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            _rewrite(mod)
    return gm
