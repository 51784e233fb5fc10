"""Cutting a step's batch into microbatches (or data-parallel shares) and weighting each
piece's loss by the labels it counts (``lower.stages.token_counter`` makes the counter)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from fxmegatron.errors import FxMegatronError


def split_batch(flat: Sequence, m: int, names: Sequence[str], what: Optional[str] = None) -> List[List]:
    """``m`` pieces (microbatches, or data-parallel shares): every tensor of the flat batch
    split along dim 0."""
    out = [[] for _ in range(m)]
    for x, name in zip(flat, names):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            if x.shape[0] % m:
                raise FxMegatronError(f"batch input {name!r} has {x.shape[0]} rows along dim 0, which "
                                      f"{what or f'microbatches={m}'} does not divide")
            for i, piece in enumerate(x.chunk(m, 0)):
                out[i].append(piece)
        else:
            for i in range(m):
                out[i].append(x)
    return out


def loss_weights(counts: Optional[Sequence[float]], total: float, dp: int, m: int) -> List[float]:
    """Each microbatch's (mean) loss weight so that the step's loss is the mean over every
    counted token of the global batch: count_i·dp / N, with N the counted tokens of the
    whole batch over the dp replicas (1/m without a counter or without a counted token)."""
    if counts is None or total == 0:
        return [1.0 / m] * m
    return [float(c) * dp / total for c in counts]
