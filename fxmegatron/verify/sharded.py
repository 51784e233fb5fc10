"""Fully sharded data parallelism (``dp_shard="full"``) under ``verify``: every replica's
ranks run at once (``simulate.run_mesh``), their ``unshard`` nodes gathering and
reduce-scattering over a simulated dp × cp group, and each parameter's gradient is put back
together from the ranks' shards.

A shard's ``.grad`` is already the reduce-scatter of every replica's and cp rank's gradient,
divided by dp (``ops.dp_gather``): the whole gradient is the dp × cp ranks' shards one after
the other (dp-major, as the group's ranks), cut to the parameter's local shape. What the
comparison then sees is what ``GradSync`` and ``sum_over_cp`` give without sharding."""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from fxmegatron.ops.dp_gather import whole


def join_dp_shards(grads: Sequence[Sequence[Mapping[str, torch.Tensor]]], shapes: Mapping[str, Sequence[int]]
                   ) -> List[Dict[str, torch.Tensor]]:
    """Per pipeline rank, each parameter's whole local gradient from ``grads[k][r]``: the
    gradients of the dp × cp group's rank ``k`` (dp-major) on pipeline rank ``r``. A parameter
    not in ``shapes`` (not sharded) is the same on every rank: rank 0's."""
    out = []
    for r in range(len(grads[0])):
        joined = {}
        for name, g in grads[0][r].items():
            if name not in shapes:
                joined[name] = g
                continue
            parts = [per[r].get(name) for per in grads]
            if any(p is None for p in parts):     # a rank whose shard got no gradient: its reduce-scatter was skipped
                continue
            joined[name] = whole(torch.cat([p.reshape(-1) for p in parts]), shapes[name])
        out.append(joined)
    return out
