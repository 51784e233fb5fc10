"""The batches ``verify`` runs: one like the example with other values, and the same with every
label of its last microbatch masked (one that counts no token)."""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def fresh_batch(example, seed: int = 1):
    """A batch shaped like ``example`` with other values: integer inputs drawn from the
    example's range of non-negative values (negative entries, e.g. -100 labels, and the
    most frequent id, e.g. padding, kept in place, and half of the rest the example's own
    ids; 0/1 masks kept), float inputs redrawn
    with the example's mean and spread. Each input is drawn on its own, so inputs that
    were one tensor in the example (labels given as input_ids) differ here."""
    g = torch.Generator().manual_seed(seed)

    def redraw(x):
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.numel() == 0:
            return x
        if x.is_floating_point():
            return (torch.randn(x.shape, generator=g) * x.float().std().nan_to_num(1.0) + x.float().mean()
                    ).to(x.dtype)
        if bool(((x == 0) | (x == 1)).all()):
            return x.clone()
        # padding is the most frequent id of a padded batch: its positions keep it, so rules
        # that treat one id specially (an embedding's padding_idx) are exercised
        values, counts = x[x >= 0].unique(return_counts=True)
        keep = (x < 0) | ((x == values[counts.argmax()]) if counts.max() > 1 else torch.zeros_like(x, dtype=torch.bool))
        lo, hi = int(x[x >= 0].min()), int(x[x >= 0].max())
        new = torch.randint(lo, hi + 1, x.shape, generator=g, dtype=x.dtype)
        # half the other positions take one of the example's ids (so the pad id also appears
        # where the loss sees it), the rest ids drawn from its range
        seen = x[x >= 0]
        picked = seen[torch.randint(0, seen.numel(), x.shape, generator=g)]
        new = torch.where(torch.rand(x.shape, generator=g) < 0.5, picked, new)
        return torch.where(keep, x, new)
    return pytree.tree_map(redraw, example)


def with_empty_microbatch(batch, labels, pieces: int):
    """``batch`` with every label of its last piece (of ``pieces``: the microbatches of every dp
    replica) set to the loss's ignore_index (``labels``: flat position -> ignore_index, inputs
    nothing but the loss's target reads), as in an SFT batch whose answers were cut away: a
    microbatch that counts no token must add nothing to the step, not its 0/0."""
    if not labels:
        return batch
    flat, spec = pytree.tree_flatten(batch)
    for i, ignore in labels.items():
        x = flat[i]
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % pieces == 0:
            x = x.clone()
            x[x.shape[0] - x.shape[0] // pieces:] = ignore
            flat[i] = x
    return pytree.tree_unflatten(flat, spec)
