"""Every tensor- and pipeline-parallel rank must be given the same batch.

Tensor-parallel ranks compute one model on one batch, each a slice of it; pipeline
ranks read the batch's inputs and labels at different stages. A data loader that
gives them different batches trains on a mixture of both and no number says so.
``ParallelModel`` therefore checks the first steps (``pm.batch_checks``, default 3; set
it to 0 to stop, or higher to check longer): each rank makes a small fingerprint of
its batch, the fingerprints are gathered over tp and over pp, and any rank whose
fingerprint differs from the group's first is named. Data-parallel ranks take
shares of one global batch and are not compared.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from fxmegatron.errors import BatchError


def fingerprint(flat: Sequence) -> torch.Tensor:
    """Two float64 numbers per tensor input (its sum and a position-weighted sum) and its
    shape: equal batches give equal fingerprints; a changed element changes them."""
    parts = []
    for x in flat:
        if not isinstance(x, torch.Tensor):
            continue
        v = x.detach().reshape(-1).to(torch.float64)
        w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device).remainder_(1021).add_(1)
        parts.append(torch.stack([v.sum(), (v * w).sum()]))
        parts.append(torch.tensor([float(s) for s in x.shape] + [float(x.ndim)], dtype=torch.float64,
                                  device=v.device))
    return torch.cat(parts) if parts else torch.zeros(1, dtype=torch.float64)


def check_same_batch(flat: Sequence, names: Sequence[str], axes: Mapping) -> None:
    """Raise ``BatchError`` naming the ranks of a tp, pp or cp group that got another batch than
    the group's first rank (cp ranks each take their part of the whole sequence). Collective
    over tp, pp and cp (every rank calls it with its batch)."""
    groups = [(dim, axes[dim]) for dim in ("tp", "pp", "cp") if dim in axes and axes[dim].size > 1]
    if not groups:
        return
    mine = fingerprint(flat)
    for dim, ax in groups:
        dev = mine.device
        if dist.get_backend(ax.group) == "nccl" and dev.type != "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
        local = mine.to(dev)
        # lengths differ only if structures differ, which _flat has already refused
        parts = [torch.empty_like(local) for _ in range(ax.size)]
        dist.all_gather(parts, local, group=ax.group)
        differ = [ax.ranks[i] for i, p in enumerate(parts) if not torch.equal(p, parts[0])]
        if differ:
            raise BatchError(
                f"the {dim} ranks {list(ax.ranks)} must all be given the same batch, but global rank(s) "
                f"{differ} got a different one than rank {ax.ranks[0]} (inputs {list(names)}): build the "
                f"data loader from the data-parallel rank only (pm.dp_rank), not the global rank")
