"""PyTorch's FSDP2 as its best users run it (torchtitan's recipe): ``fully_shard`` on every
decoder layer and on the root, fp32 parameters sharded over dp with bf16 compute and fp32
gradient reduction (``MixedPrecisionPolicy``), each decoder layer compiled (and wrapped in
``checkpoint_wrapper`` for ``-rfull``), torch's fused AdamW on the fp32 shards after
``clip_grad_norm_``-style clipping: AdamW on fp32 masters, as every other row."""
from __future__ import annotations

import torch

from e2e.builders import Job, accumulate, decoder_layers
from e2e.master_weights import full_tensor


class _ClippedAdamW:
    """torch.optim.AdamW (fused on CUDA) whose ``step(coefficient)`` first scales the gradients
    by the clip coefficient (what ``clip_grads_with_norm_`` does), as the run's optimizer phase
    calls FusedAdamW."""

    def __init__(self, params, lr: float, fused: bool):
        self.params = [p for p in params if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, fused=fused)

    @torch.no_grad()
    def step(self, coefficient=None):
        if coefficient is not None:
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coefficient)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True):
        self.opt.zero_grad(set_to_none=set_to_none)


def build_fsdp2(lay, spec, dev, dtype, batch, meshes, ref_state=None, **_):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = meshes(dp=lay.dp)
    if lay.rep > 1:     # HSDP: fully_shard on a 2-D mesh replicates over its first axis, shards over its second
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(mesh.device_type, (lay.rep, lay.dp // lay.rep),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    model = spec.meta(torch.float32)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}    # computed on the CPU (rotary)
    layers = decoder_layers(model)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for i in range(len(layers)):
        layer = layers[i]
        if lay.recompute == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        if lay.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp)
        layers[i] = layer
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=dev)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in buffers:
                b.copy_(buffers[n])
    state = ref_state if ref_state is not None else {
        k: v for k, v in spec.plain("cpu", dtype).state_dict().items()}
    set_model_state_dict(model, {k: v.to(torch.float32) for k, v in state.items()},
                         options=StateDictOptions(full_state_dict=True))
    model.train()
    params = list(model.parameters())

    def norm():
        return full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0))

    def adamw(lr):
        return _ClippedAdamW(params, lr, fused=dev.type == "cuda")
    # data parallel: this rank's share of the global batch; the step's loss is the mean over the ranks
    # (each share holds as many tokens), as fxmegatron's train_step returns it
    mine = accumulate(model, spec, spec.chunk(batch, lay.dp)[torch.distributed.get_rank()], lay.m)

    def fwd_bwd():
        loss = mine().detach().float().clone()
        torch.distributed.all_reduce(loss)
        return loss / lay.dp
    return Job(params, fwd_bwd, norm,
               lambda n: torch.nn.utils.clip_grads_with_norm_(params, 1.0, n), [model], adamw)
