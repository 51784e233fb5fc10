"""The trainer's load-imbalance figure at ``layout.ep`` > 1: ``moe_imbalance`` in loss.csv.

The expert-parallel rewrite records, per mixture-of-experts block, the rows each of the rank's
E/ep experts took in every forward (over all ep ranks' tokens: ``ops.expert_load``). After a
step, each rank puts its block sums at its experts' place in a [blocks, E] tensor and the
data-parallel ranks sum them (each ep group gives its E/ep slices, every ep group its own
tokens): each block's rows per expert over the step's whole global batch, all microbatches.
The figure is the largest, over blocks, of (the busiest expert's rows / the mean over the E
experts): 1.0 when every expert of every block got the same share, E/k when a block sent every
token to the same k experts. A max over all ranks gives every rank the figure of all pipeline
stages' blocks (the tp ranks of a block count the same rows)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fxmegatron.ops.expert_load import take_expert_counts


# torch.compile modes that replay CUDA graphs: a replay runs the kernels and not the recording op
# (a Python call), so the sums would stand still; the figure is not logged under them
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def expert_parallel(pm, compile_mode=False) -> bool:
    """Whether this run logs the figure: ep > 1, and no CUDA-graph replay (``CUDA_GRAPH_MODES``)."""
    ep = pm.program.axes.get("ep")
    return ep is not None and ep.size > 1 and compile_mode not in CUDA_GRAPH_MODES


def discard() -> None:
    """Forget what forwards outside a training step (evaluation) recorded."""
    take_expert_counts()


def moe_imbalance(pm, device) -> Optional[float]:
    """This step's figure (module docstring), the same on every rank (collective: every rank
    calls it after the step, when ``expert_parallel(pm)``); None where no block recorded rows."""
    sums = take_expert_counts()
    ep = pm.program.axes["ep"]
    worst = 0.0
    if sums:
        names = sorted(sums)
        local = [sums[b].to(device) for b in names]                    # E/ep rows each
        full = torch.zeros(len(names), max(c.numel() for c in local) * ep.size, dtype=torch.int64, device=device)
        for i, c in enumerate(local):
            full[i, ep.rank * c.numel():(ep.rank + 1) * c.numel()] = c
        dp = pm.program.axes["dp"]
        if dp.size > 1:     # the same blocks on every rank of the dp group (one pp stage, one tp rank)
            dist.all_reduce(full, group=dp.group)
        for i, c in enumerate(local):
            rows = full[i, :c.numel() * ep.size].double()
            if rows.sum() > 0:
                worst = max(worst, (rows.max() / rows.mean()).item())
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([worst], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst = t.item()
    return worst if worst > 0 else None
