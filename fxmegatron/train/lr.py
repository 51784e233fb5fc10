"""Learning rate as a function of the step alone (no scheduler state: a resumed run at any
layout gets the same rates from the step it resumes at)."""
from __future__ import annotations

import math


def lr_at(step: int, steps: int, lr: float, min_lr: float, warmup: int, decay: str,
          wsd_fraction: float = 0.2) -> float:
    """The rate of optimizer step ``step`` (0-based) of ``steps``: linear warmup over the first
    ``warmup`` steps from lr/warmup to lr, then ``decay``: "cosine" or "linear" to ``min_lr`` at
    the last step, "constant", or "wsd" (warmup-stable-decay: constant, then linear to ``min_lr``
    over the last ``wsd_fraction`` of the steps)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    last = max(1, steps - 1 - warmup)
    t = min(1.0, (step - warmup) / last)
    if decay == "constant":
        return lr
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if decay == "linear":
        return lr + (min_lr - lr) * t
    if decay == "wsd":
        n_decay = max(1, round(wsd_fraction * steps))
        start = steps - n_decay
        if step < start:
            return lr
        return lr + (min_lr - lr) * min(1.0, (step - start + 1) / n_decay)
    raise ValueError(f"decay {decay!r}: expected cosine, linear, constant or wsd")
