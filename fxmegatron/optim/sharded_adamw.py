"""``ShardedAdamW``: ``FusedAdamW`` on this data-parallel rank's share of the parameters
(``dp_shard="optimizer"``, ZeRO-1).

The data-parallel ranks each keep fp32 masters, m and v for the elements of their pieces of
the gradient buckets only (``runtime.sharded_dp``): a ``FusedAdamW`` over one tensor per
segment, each a view of its parameter's own storage, whose gradient is the segment's slice of
the reduce-scattered piece. The step updates those elements (the same AdamW, element by
element, as on the whole parameter: AdamW has no term across elements) and then all-gathers
every bucket so that each rank holds the whole updated parameters again. Per parameter
element a rank holds 12/world bytes of optimizer state instead of 12.

Hyperparameters are per group, as in ``FusedAdamW``: ``param_groups`` are the segments'
groups, in the order of the groups given, so an LR scheduler or the trainer setting
``group["lr"]`` works unchanged."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from fxmegatron.optim.fused_adamw import FusedAdamW
from fxmegatron.runtime.sharded_dp import Segment, gather_params, segments


class ShardedAdamW:
    """AdamW over this rank's segments of ``grad_sync``'s buckets (module docstring). ``params``:
    the ParallelModel's parameters or groups of them, as for ``FusedAdamW``; every parameter
    ``grad_sync`` reduces must be in exactly one group."""

    def __init__(self, grad_sync, params: Iterable, **hyper):
        self.sync = grad_sync
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        group_of: Dict[int, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) in group_of:
                    raise ValueError(f"ShardedAdamW: a parameter of shape {tuple(p.shape)} is in groups "
                                     f"{group_of[id(p)]} and {gi}")
                group_of[id(p)] = gi
        missing = [tuple(p.shape) for p in grad_sync.params if id(p) not in group_of]
        if missing:
            raise ValueError(f"ShardedAdamW: {len(missing)} parameter(s) the gradients are reduced for are in no "
                             f"group (shapes {missing[:3]}): the optimizer owns a share of every one")
        self.segments: List[Segment] = segments(grad_sync.buckets, grad_sync.world, grad_sync.rank)
        # one leaf per segment, a view of its parameter's storage: the inner optimizer writes the
        # updated values there
        self._views = [nn.Parameter(s.param.detach().view(-1)[s.start:s.stop]) for s in self.segments]
        seg_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        for s, v in zip(self.segments, self._views):
            seg_groups[group_of[id(s.param)]]["params"].append(v)
        seg_groups = [g for g in seg_groups if g["params"]]
        if not seg_groups:       # a bucket smaller than the group leaves some rank nothing
            self.inner: Optional[FusedAdamW] = None
            self.param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
            for g in self.param_groups:
                g.setdefault("lr", hyper.get("lr", 1e-3))
        else:
            self.inner = FusedAdamW(seg_groups, **hyper)
            self.param_groups = self.inner.param_groups

    @torch.no_grad()
    def step(self, grad_scale: Union[Tensor, float, None] = None) -> None:
        """The segments' AdamW step on the reduced pieces (``grad_scale`` as in ``FusedAdamW``),
        then the all-gather of the parameters. Collective over the data-parallel group."""
        pieces = self.sync.pieces
        if self.inner is not None:
            for s, v in zip(self.segments, self._views):
                piece = pieces[s.bucket]
                if piece is None:
                    raise RuntimeError("ShardedAdamW.step before train_step: no reduced gradient pieces")
                v.grad = piece[s.at:s.at + s.numel]
            self.inner.step(grad_scale)
        gather_params(self.sync.buckets, self.segments, self.sync.world, self.sync.rank, self.sync.group)
        self.sync.pieces = [None] * len(self.sync.buckets)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The whole gradients are dropped when their bucket is reduced; nothing to do."""

    def state_bytes(self) -> int:
        """Bytes of fp32 state (masters, m, v) this rank holds."""
        if self.inner is None:
            return 0
        return self.inner.state_bytes()
