"""The whole (unsplit) model's gradient norm from one rank's shards, and clipping by it, as
``torch.nn.utils.clip_grad_norm_`` computes them on the unmodified model."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from fxmegatron.mesh import Axis


def grad_norm(named_params: Iterable[Tuple[str, nn.Parameter]], holders: Callable[[str], int],
              axes: Mapping[str, Axis], device) -> torch.Tensor:
    """fp32, on the device, no host sync; collective over tp and pp. ``holders(name)``: how
    many ranks of tp x pp hold the whole gradient ``name`` (a replicated weight on each tp
    rank, a tied weight on several stages): its square counts once."""
    by_holders: Dict[int, List[torch.Tensor]] = {}
    for name, p in named_params:
        if p.grad is not None:
            by_holders.setdefault(holders(name), []).append(p.grad.detach())
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for n, grads in by_holders.items():
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        sq += torch.stack(norms).square().sum() / n
    for dim in ("tp", "pp"):
        if axes[dim].size > 1:
            dist.all_reduce(sq, group=axes[dim].group)
    return sq.sqrt()


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
