"""Under ``compile=True`` on CUDA: refuse the programs fxmegatron is known to compile into
wrong numbers, by name, before anything runs.

One rule, from measurements on an H100 on 2026-11-25:

* a vocab-parallel cross-entropy whose logits row (the rank's V/t columns) is not a
  multiple of ``ROW_ALIGN_BYTES`` bytes (``passes/loss_grad_in_place.py``'s alignment).

With such a row the compiled program's loss was right and its gradients were wrong:

* Hugging Face GPT-2 with its vocabulary of 50257, fp32: the first step's gradient norm
  was 42023.9 against 1.58;
* the GPT-2 and Llama test families with a vocabulary of 2053, fp32: 42% of one
  gradient's elements differed.

The same programs uncompiled were right, and the test families compiled with a vocabulary
of 128 gave the uncompiled gradients exactly.

The cause, found on CPU afterwards:

* on CUDA, inductor's ``pad_mm`` pads the LM head's matmul on the joint graph when the
  vocabulary is unaligned, after AOT autograd functionalized the loss's in-place backward;
* ``auto_functionalized_v2`` replays the view of the logits it recorded, as an
  ``as_strided`` with the unpadded strides, onto the padded buffer, so the kernel reads
  misaligned rows.

Forcing ``pad_mm`` on the CPU reproduces the wrong gradients.
``passes/loss_grad_in_place.py`` now keeps the backward out of place for such rows, and the
CPU reproduction then matches exactly (``tests/test_loss_grad_in_place.py``). No GPU time was
left to see the fix hold on a GPU, so this rule still refuses.
``tests/test_compile_cuda.py::test_an_unaligned_vocabulary_compiled_with_the_rule_lifted`` is
the check. When it passes on a GPU, the rule can go. The error names the node and its module,
and the way out: pad the vocabulary, as Megatron does (``make-vocab-size-divisible-by``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.errors import CompileError
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.passes.loss_grad_in_place import ROW_ALIGN_BYTES


def _producer_module(n: fx.Node) -> str:
    """The module path of the op that made ``n``, looking through the views and casts after it."""
    for _ in range(16):
        if module_path(n) or n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            break
        n = n.args[0]
    return module_path(n) or "<top>"


def refuse_known_miscompiles(gm: fx.GraphModule, tp: int = 1) -> int:
    """Raise ``CompileError`` where a rule above fails; returns how many losses it checked."""
    checked = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not vocab_parallel_cross_entropy:
            continue
        v = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        checked += 1
        width, size = v.shape[-1], v.element_size()
        if width * size % ROW_ALIGN_BYTES:
            multiple = ROW_ALIGN_BYTES // size * tp
            raise CompileError(
                f"compile=True on CUDA: the loss {n.name} (in {module_path(n) or '<top>'}, of the logits of "
                f"{_producer_module(n.args[0])}) reads logits rows of "
                f"{width} {str(v.dtype).replace('torch.', '')} columns on each of tp={tp} ranks, not a multiple of "
                f"{ROW_ALIGN_BYTES} bytes. Compiled, such a program computed wrong gradients (GPT-2's vocabulary of "
                f"50257: a gradient norm 26 000 times the true one on an H100), so it is refused. Pad the "
                f"vocabulary to a multiple of {multiple} (Hugging Face: model.resize_token_embeddings(n, "
                f"pad_to_multiple_of={multiple})), or use compile=False.")
    return checked
