"""Megatron's mixed precision with torch's optimizer (``--optimizer master``, every layout): bf16
parameters in the model, fp32 master weights and gradient buffers here, torch's AdamW on
the masters."""
from __future__ import annotations

import torch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered; a plain tensor itself)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor's local data: a DTensor's shard on this rank, a plain tensor itself."""
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


class MasterWeightAdamW:
    """Megatron's mixed precision: the model keeps its (bf16) parameters; this keeps fp32
    master copies and fp32 gradient buffers. ``step()`` copies the (already clipped)
    gradients into the buffers, runs AdamW on the masters and copies them back into the
    model's parameters. DTensor parameters are handled through their local shards."""

    def __init__(self, params, lr: float, fused: bool):
        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            self.model_data = [local_tensor(p.detach()) for p in self.params]
            self.masters = [t.to(torch.float32, copy=True) for t in self.model_data]
            self.grads = [torch.zeros_like(m) for m in self.masters]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, fused=fused)

    @staticmethod
    def _grad(p):
        from torch.distributed.tensor import DTensor
        g = p.grad
        if isinstance(g, DTensor):
            if tuple(g.placements) != tuple(p.placements):   # e.g. a Partial gradient of a Replicate weight
                g = g.redistribute(p.device_mesh, p.placements)
            return g.to_local()
        return g

    @torch.no_grad()
    def step(self):
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if live:
            torch._foreach_copy_([self.grads[i] for i in live], [self._grad(self.params[i]) for i in live])
        have = set(live)
        for i, m in enumerate(self.masters):
            m.grad = self.grads[i] if i in have else None
        self.opt.step()
        torch._foreach_copy_(self.model_data, self.masters)
        for p in self.params:
            p.grad = None
