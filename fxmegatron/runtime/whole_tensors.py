"""Whole tensors of a ``ParallelModel`` (a mixin): the unmodified model's parameters and
gradients from every rank's pieces, and, under ``dp_shard="full"``, a parameter's whole local
(tensor-parallel) piece from its data-parallel shards and back (the checkpoint reads both)."""
from __future__ import annotations

from typing import Dict

import torch

from fxmegatron.ops.dp_gather import take_shard, whole
from fxmegatron.runtime.gather import gather_layout, gather_stages
from fxmegatron.runtime.sharded_dp import SHARDED_OPTIMIZER, all_gather


class WholeTensors:
    """What ``ParallelModel`` gathers; it sets ``program``, ``dp_shard``, ``pp_size`` and
    ``grad_syncs``."""

    def param_dims(self, name: str) -> int:
        """How many dims parameter ``name`` has in the unmodified model (a rule such as "no weight
        decay below 2 dims" reads this: under ``dp_shard="full"`` every parameter here is a flat
        shard)."""
        return len(self.program.global_params[self.program.aliases.get(name, name)][0])

    def whole_local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (parameter ``name`` or a tensor of its shape: its gradient, an optimizer state)
        as this rank's whole tensor-parallel piece: under ``dp_shard="full"`` all-gathered from
        the data-parallel shards (collective over dp × cp, an expert weight's over the ranks
        holding the same experts: ``program.shard_axis``), otherwise ``t`` itself (and a 0-d
        tensor, such as a step count)."""
        shape = self.program.dp_shards.get(name) if self.dp_shard == "full" else None
        if shape is None or t.dim() == 0:
            return t
        sync = self.program.shard_axis(name)
        out = t.new_empty(t.numel() * sync.size)
        all_gather(out, t.detach().contiguous(), sync.group)
        return whole(out, shape)

    def shard_local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The reverse of ``whole_local``: this rank's shard of a whole local piece (no
        communication), or ``t`` itself when ``name`` is not sharded."""
        shape = self.program.dp_shards.get(name) if self.dp_shard == "full" else None
        if shape is None or t.dim() == 0:
            return t
        sync = self.program.shard_axis(name)
        return take_shard(t, sync.size, sync.rank)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Whole parameters under every name the unmodified model uses, tied names
        included, on every rank: loads into the unmodified model with strict=True.
        Collective over tp and pp (and dp × cp under ``dp_shard="full"``): every rank must
        call it."""
        ax, layout = self.program.axes, self.program.param_layout
        out = {n: gather_layout(self.whole_local(n, p), layout(n), ax) for n, p in self.named_parameters()}
        pipe = self.program.pipeline
        if pipe is not None and self.pp_size > 1:
            out = gather_stages(out, self.program.param_order, self.program.global_params, pipe.holders(),
                                self.program.axes["pp"], self.program.device)
        for alias, canon in self.program.aliases.items():
            if canon in out:
                out[alias] = out[canon]
        return out

    def full_grads(self) -> Dict[str, torch.Tensor]:
        """Whole gradients of this rank's parameters (collective over tp, and over dp × cp under
        a ``dp_shard`` mode: the reduced ones, from every rank's pieces or shards)."""
        ax, layout = self.program.axes, self.program.param_layout
        grads = {n: p.grad for n, p in self.named_parameters() if p.grad is not None}
        if self.dp_shard in SHARDED_OPTIMIZER:
            whole = {k: g for s in self.grad_syncs for k, g in s.whole_grads().items()}
            grads = {n: whole[id(p)] for n, p in self.named_parameters() if id(p) in whole}
        return {n: gather_layout(self.whole_local(n, g), layout(n), ax) for n, g in grads.items()}
