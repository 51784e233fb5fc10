"""The whole model's gradient norm, clipping and the optimizer of a ``ParallelModel`` (a mixin):
the norm as ``torch.nn.utils.clip_grad_norm_`` computes it on the unmodified model, from this
rank's shards (``runtime.grad_norm``)."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from fxmegatron.placement import R
from fxmegatron.runtime.grad_norm import grad_norm, scale_grads_
from fxmegatron.runtime.sharded_dp import SHARDED_OPTIMIZER


class GradientStep:
    """What ``ParallelModel`` does with its gradients; it sets ``program``, ``dp_shard``,
    ``tp_rank``, ``pp_rank``, ``grad_sync`` and ``grad_syncs``, and calls ``gradient_setup``."""

    def gradient_setup(self, program) -> None:
        pipe = program.pipeline
        self._holders: Dict[str, Tuple[int, ...]] = pipe.holders() if pipe is not None else {}
        self._norm_slots = {n: i for i, n in enumerate(program.param_order)}   # grad_norm's sum order

    def _counts_square(self, name: str) -> bool:
        """Whether this rank's gradient square of ``name`` enters the norm: each tp shard once
        (a weight replicated over tp on tp rank 0), on the first pipeline rank holding it."""
        if self.placement(name) == R and self.tp_rank != 0:
            return False
        ep = self.program.axes.get("ep")
        if ep is not None and ep.size > 1 and name not in self.program.experts and ep.rank != 0 \
                and self.dp_shard == "none":
            return False        # replicated over ep: counted on its first rank (a piece or a shard: on its own)
        holders = self._holders.get(name)
        return holders is None or holders[0] == self.pp_rank

    def grad_norm(self) -> torch.Tensor:
        """The norm of the whole (unsplit) model's gradient, as ``torch.nn.utils.clip_grad_norm_``
        on the unmodified model computes it (fp32, on the device, no host sync). Collective over
        tp and pp (every rank must call it)."""
        sync = self.program.axes.get("dp_cp", self.program.axes["dp"])
        if self.dp_shard in SHARDED_OPTIMIZER:      # each rank holds its pieces' sum; the squares add up over the group
            names = {id(p): n for n, p in self.named_parameters()}
            named = [piece for s in self.grad_syncs for piece in s.named_pieces(names)]
            # an expert's elements are each on one rank of dp × cp as well (ep cuts the experts, the
            # experts' own group their pieces, ep × that group = dp × cp): no sum over ep after it
            return grad_norm(named, self._norm_slots, self._counts_square, self.program.axes, self.program.device,
                             partial_over=sync, sum_over=("tp", "pp"))
        named = [(n, p.grad) for n, p in self.named_parameters() if p.grad is not None]
        if self.dp_shard == "full":     # shards: each element on one rank of dp × cp (an expert's too), as above
            return grad_norm(named, self._norm_slots, self._counts_square, self.program.axes, self.program.device,
                             partial_over=sync, sum_over=("tp", "pp"))
        return grad_norm(named, self._norm_slots, self._counts_square, self.program.axes, self.program.device)

    def adamw(self, params=None, **hyper):
        """The optimizer for this rank: ``fxmegatron.optim.FusedAdamW`` over ``params`` (this
        rank's parameters, or groups of them; default all), or under ``dp_shard="optimizer"`` (or "gradients") a
        ``ShardedAdamW`` holding this rank's share of its state (``step`` then also all-gathers
        the updated parameters). Under ``dp_shard="full"`` the parameters are shards already: a
        ``FusedAdamW`` over them. ``hyper``: ``lr``, ``betas``, ``eps``, ``weight_decay``."""
        from fxmegatron.optim import FusedAdamW
        from fxmegatron.optim.sharded_adamw import ShardedAdamW
        params = list(self.parameters()) if params is None else params
        if self.dp_shard in SHARDED_OPTIMIZER:
            return ShardedAdamW(self.grad_syncs, params, **hyper)
        return FusedAdamW(params, **hyper)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that the norm of the whole (unsplit) model's gradient is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` on the unmodified model would; returns
        that norm. Collective over tp and pp (every rank must call it). With
        ``fxmegatron.optim.FusedAdamW``, ``opt.step(clip_coefficient(pm.grad_norm(), max_norm))``
        does the same without this pass over the gradients."""
        from fxmegatron.optim import clip_coefficient
        if self.dp_shard in SHARDED_OPTIMIZER:
            raise ValueError(f"clip_grad_norm_ under dp_shard={self.dp_shard!r}: the whole gradients are gone once "
                             "reduced; pass the clip coefficient to the optimizer: "
                             "opt.step(clip_coefficient(pm.grad_norm(), max_norm))")
        norm = self.grad_norm()
        scale_grads_(self.parameters(), clip_coefficient(norm, max_norm))
        return norm
