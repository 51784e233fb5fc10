"""The collectives that appear as named nodes in transformed graphs.

One functional all-reduce is a ``torch.library`` custom op (so fake tensors,
export and compile see an opaque, shape-preserving op); Megatron's conjugate
pair f/g is built on it as autograd functions:

* ``copy_to_tp``   (f): identity forward, all-reduce backward
* ``reduce_from_tp`` (g): all-reduce forward, identity backward

A group is named by its ``group_name`` string (as torch's functional
collectives do); the empty name means a group of one, where every collective
is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _group(group_name: str):
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("fxmegatron::all_reduce", mutates_args=())
def all_reduce(x: Tensor, reduce_op: str, group_name: str) -> Tensor:
    out = x.contiguous().clone()
    pg = _group(group_name)
    if pg is not None and dist.get_world_size(pg) > 1:
        dist.all_reduce(out, op=_OPS[reduce_op], group=pg)
    return out


@all_reduce.register_fake
def _(x, reduce_op, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, "sum", ctx.group_name), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        return all_reduce(x, "sum", group_name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: Tensor, group_name: str) -> Tensor:
    """Megatron's f: enters a tensor-parallel region (all-reduce in backward)."""
    return _CopyToTP.apply(x, group_name)


def reduce_from_tp(x: Tensor, group_name: str) -> Tensor:
    """Megatron's g: leaves a tensor-parallel region (all-reduce in forward)."""
    return _ReduceFromTP.apply(x, group_name)


def all_reduce_max(x: Tensor, group_name: str) -> Tensor:
    """Max over the group, without gradient (used for a softmax's shift)."""
    return all_reduce(x.detach(), "max", group_name)


def local_shard(x: Tensor, dim: int, rank: int, world: int) -> Tensor:
    """This rank's slice of a replicated tensor: no communication."""
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)


# What each collective-bearing graph function communicates, for the dump.
COLLECTIVES = {
    copy_to_tp: ("f", "identity forward, all-reduce(sum) backward"),
    reduce_from_tp: ("g", "all-reduce(sum) forward, identity backward"),
    all_reduce_max: ("max", "all-reduce(max) forward, no gradient"),
}
