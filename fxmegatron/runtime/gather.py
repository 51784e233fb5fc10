"""Whole tensors from shards: over every axis a layout shards them over (tp today), over pp from the stage that holds them,
and the gradient sum of weights that several pipeline stages use."""
from __future__ import annotations

import math
from typing import Dict, Mapping, Sequence, Tuple

import torch
import torch.distributed as dist

from fxmegatron.mesh import Axis
from fxmegatron.placement import Partial, Placement, Placements, R, join_shards


def gather_tp(local: torch.Tensor, plc: Placement, tp: Axis) -> torch.Tensor:
    """The whole tensor from each rank's shard over one axis (tp, by name only: any axis's
    ``Axis`` serves); a copy when replicated."""
    if tp.size == 1 or plc == R:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp.group)
    return join_shards(parts, plc)


def gather_layout(local: torch.Tensor, layout: Placements, axes: Mapping[str, Axis]) -> torch.Tensor:
    """The whole tensor from every rank's piece, gathered over each axis the layout shards it
    over (the reverse of ``placement.take_layout``: last cut, first joined); a copy when none
    does. A partial value is not a piece of a whole one: refused."""
    if any(isinstance(p, Partial) for _, p in layout.axes):
        raise ValueError(f"{layout}: a partial value has no whole tensor to gather")
    out = local
    for axis in reversed(layout.sharded()):
        ax = axes.get(axis)
        if ax is not None and ax.size > 1:
            out = gather_tp(out, layout.on(axis), ax)
    return local.detach().clone() if out is local else out


def gather_stages(mine: Mapping[str, torch.Tensor], order: Sequence[str],
                  global_params: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
                  holders: Mapping[str, Tuple[int, ...]], pp: Axis, device) -> Dict[str, torch.Tensor]:
    """Each parameter broadcast over pp from the first stage that holds it."""
    out = {}
    for name in order:
        shape, dtype = global_params[name]
        t = mine[name].to(device) if name in mine else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=pp.ranks[holders[name][0]], group=pp.group)
        out[name] = t
    return out


def sum_shared_grads(params: Mapping[str, torch.nn.Parameter],
                     shared: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]], pp: Axis, device) -> None:
    """Weights used on several pipeline ranks (a tied embedding and LM head): their gradients
    summed over the pipeline group in one all-reduce, as the unmodified model sums both
    uses. A rank without the weight contributes zeros."""
    if not shared or pp.size == 1:
        return
    flat = []
    for name, (shape, dtype) in shared.items():
        p = params.get(name)
        g = p.grad if p is not None and p.grad is not None else torch.zeros(shape, dtype=dtype, device=device)
        flat.append(g.reshape(-1))
    buf = torch.cat(flat)
    dist.all_reduce(buf, group=pp.group)
    off = 0
    for name, (shape, dtype) in shared.items():
        n = math.prod(shape)
        p = params.get(name)
        if p is not None:
            p.grad = buf[off:off + n].view(shape).clone()
        off += n
