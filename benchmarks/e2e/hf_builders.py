"""PyTorch-native tensor parallelism (DTensor, ``parallelize_module``) for unmodified Hugging
Face Llama-style models (Llama, Qwen2, Mistral): torchtitan's Llama plan on HF's module names.

Between the decoder layers the hidden states stay DTensors sharded over the sequence
(``Shard(1)``), not local tensors as in torchtitan: HF's model reads the sequence length off the
embedding's output (``inputs_embeds.shape[1]``) for the position ids, and so for the rotary
cos/sin handed to every layer, and a DTensor reports the global length. The layers' outputs are
DTensors too (``use_local_output=False`` on o_proj/down_proj), so that the residual adds add
DTensors. Inside a layer the attention and MLP inputs are gathered (``Shard(1) -> Replicate``)
and handed on as local tensors; HF's attention views ``(*input_shape, -1, head_dim)``, so each
rank runs its heads / tp query heads and kv heads / tp kv heads unmodified.

The loss is the model's own (``ForCausalLMLoss``: logits upcast to fp32, labels shifted, mean
cross-entropy) under ``loss_parallel()``: the LM head's logits stay sharded over the vocabulary
(``Shard(-1)``) and cross-entropy runs on the shards, the full logits never gathered."""
from __future__ import annotations

import torch

from e2e.builders import accumulate, enable_async_tp, torch_job


def llama_plans():
    """(the plan of a decoder layer, the plan of the model around the layers)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    gather = dict(desired_input_layouts=(Replicate(),), use_local_output=True)
    layer = {
        "input_layernorm": SequenceParallel(),
        # HF calls self_attn with keywords, the MLP with one positional input
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), **gather),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    outer = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        # loss parallel: logits stay sharded over the vocabulary, cross-entropy runs on the shards
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    return layer, outer


def build_hf_native(lay, spec, dev, dtype, batch, meshes):
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    mesh = meshes(tp=lay.tp)
    model = spec.plain(dev, dtype)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    layer_plan, outer_plan = llama_plans()
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(model, mesh, outer_plan)
    if tied:
        # both plans shard the (vocab, hidden) weight by rows (Shard(0)), each into its own
        # DTensor parameter: tie them again, so that one weight gets both gradients
        model.lm_head.weight = model.model.embed_tokens.weight
    if lay.async_tp:
        enable_async_tp(mesh)
    for i in range(len(model.model.layers)):
        model.model.layers[i] = torch.compile(model.model.layers[i])
    return torch_job(list(model.parameters()), accumulate(model, spec, batch, lay.m, context=loss_parallel),
                     [model])
