"""The whole (unsplit) model's gradient norm from one rank's shards, and clipping by it, as
``torch.nn.utils.clip_grad_norm_`` computes them on the unmodified model.

The squares are summed in one order whatever the pipeline cut: each parameter's square goes
into its slot of a vector in the model's parameter order, one pipeline rank fills it (the
others add zeros, which is exact), and the vector is summed at the end. So a run resumed
with another pp computes the same norm, bit for bit, and clips by the same coefficient."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fxmegatron.mesh import Axis


def grad_norm(named_grads: Iterable[Tuple[str, torch.Tensor]], slot: Mapping[str, int],
              counts: Callable[[str], bool], axes: Mapping[str, Axis], device,
              partial_over: Optional[Axis] = None, sum_over: Tuple[str, ...] = ("tp", "pp", "ep")) -> torch.Tensor:
    """fp32, on the device, no host sync; collective over tp and pp. ``named_grads``: (parameter
    name, its gradient on this rank); with ``partial_over``, pieces of it (a name may come more
    than once), the squares then summed over that axis first (sharded data parallelism's
    pieces: each element is on one rank of the group). ``slot``: every parameter
    name of the whole model -> its place in the model's order; ``counts(name)``: whether this
    rank's square of ``name`` is counted: once per tp shard (a weight replicated over tp counts
    on tp rank 0 only) and on one pipeline rank (a tied weight's first holder). A gradient that
    is not counted but is not finite makes the norm NaN. ``sum_over``: the axes the squares are
    summed over after ``partial_over``'s."""
    idx: List[int] = []
    grads: List[torch.Tensor] = []
    uncounted: List[torch.Tensor] = []
    for name, g in named_grads:
        if counts(name):
            idx.append(slot[name])
            grads.append(g.detach())
        else:
            uncounted.append(g.detach())
    # the last entry: 0, or NaN when a gradient this rank does not count is not finite (a NaN in
    # one tp rank's copy of a replicated weight would otherwise reach no norm, and that rank
    # alone would step its copy to NaN); added after the sum, + 0.0 changes no bit
    sq = torch.zeros(len(slot) + 1, dtype=torch.float32, device=device)
    if grads:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        where = torch.tensor(idx, dtype=torch.int64)
        if sq.is_cuda:    # a pageable copy would wait for the backward still queued: pinned, async
            where = where.pin_memory().to(sq.device, non_blocking=True)
        # accumulate: a name may have several pieces; 0 + x is x, so whole gradients keep their bits
        sq.index_put_((where,), torch.stack(norms).square(), accumulate=True)
    if uncounted:
        sq[-1] = (torch.stack(torch._foreach_norm(uncounted, 2.0, dtype=torch.float32)) * 0.0).sum()
    if partial_over is not None and partial_over.size > 1:
        dist.all_reduce(sq, group=partial_over.group)
    for dim in sum_over:
        if dim in axes and axes[dim].size > 1:
            dist.all_reduce(sq, group=axes[dim].group)
    return (sq[:-1].sum() + sq[-1]).sqrt()


def scale_grads_(params: Iterable[nn.Parameter], coef: torch.Tensor) -> None:
    """Multiply every gradient by ``coef`` (a 0-d tensor), one foreach kernel per dtype: a
    mixed-dtype ``_foreach_mul_`` falls back to one kernel per tensor (as torch's clip,
    which computes its norm in that dtype)."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype, grads in by_dtype.items():
        torch._foreach_mul_(grads, coef.to(dtype))
