"""The collectives that appear as named nodes in transformed graphs.

One functional all-reduce is a ``torch.library`` custom op (so fake tensors,
export and compile see an opaque, shape-preserving op); Megatron's conjugate
pair f/g is built on it as autograd functions:

* ``copy_to_tp``   (f): identity forward, all-reduce backward
* ``reduce_from_tp`` (g): all-reduce forward, identity backward
* ``mean_grad``: identity forward, the ranks' gradients averaged backward (a weight
  every rank computes the gradient of alone: ``passes.tensor_parallel.same_grads``)

A group is named by its ``group_name`` string (as torch's functional
collectives do) and resolved at run time by ``fxmegatron.ops.groups``: a process
group, a rank of a group simulated in this process, or (the empty name) a group
of one, where every collective is the identity.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fxmegatron.ops.groups import communicator
from fxmegatron.ops.registry import register


@torch.library.custom_op("fxmegatron::all_reduce", mutates_args=())
def all_reduce(x: Tensor, reduce_op: str, group_name: str) -> Tensor:
    comm = communicator(group_name)
    return x.contiguous().clone() if comm is None else comm.all_reduce(x, reduce_op)


@all_reduce.register_fake
def _(x, reduce_op, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxmegatron::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    comm = communicator(group_name)
    if comm is None or world == 1:
        return x.contiguous().clone()
    # the gather is [world, *x.shape]: moving that world axis next to ``dim`` and merging the
    # two is the one copy a dim > 0 needs (none at 0)
    out = comm.all_gather(x)
    shape = list(x.shape)
    shape[dim] *= world
    return out.movedim(0, dim).reshape(shape)


@all_gather.register_fake
def _(x, dim, world, group_name):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


@torch.library.custom_op("fxmegatron::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    comm = communicator(group_name)
    if comm is None or world == 1:
        return x.contiguous().clone()
    n = x.shape[dim] // world
    # [..., world * n, ...] -> [world, ..., n, ...]: each rank's piece becomes one contiguous
    # block (the one copy a dim > 0 needs)
    pieces = x.reshape(x.shape[:dim] + (world, n) + x.shape[dim + 1:]).movedim(dim, 0).contiguous()
    return comm.reduce_scatter(pieces)


@reduce_scatter.register_fake
def _(x, dim, world, group_name):
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, world, group_name):
        ctx.args = (dim, world, group_name)
        return all_gather(x, dim, world, group_name)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, *ctx.args), None, None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, world, group_name):
        ctx.args = (dim, world, group_name)
        return reduce_scatter(x, dim, world, group_name)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, *ctx.args), None, None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world, group_name):
        ctx.args = (dim, world, group_name)
        # a copy, never a view of x: under torch.compile on CUDA, a Function whose forward
        # returned a narrow view of its input got a zero gradient (measured 2026-11-21 on two
        # H200s, dynamo alone included: benchmarks/compile_tp_check.py; the gloo/CPU runs were
        # right). It was why compile with sequence parallelism trained a frozen wpe.
        return local_shard(x, dim, rank, world).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, *ctx.args), None, None, None, None


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, world, group_name):
        ctx.args = (dim, rank, world)
        return all_gather(x, dim, world, group_name)

    @staticmethod
    def backward(ctx, grad):
        return local_shard(grad, *ctx.args).contiguous(), None, None, None, None


def all_gather_seq(x: Tensor, dim: int, rank: int, world: int, group_name: str) -> Tensor:
    """Leave the sequence-split region into a replicated one: all-gather forward; the
    gradient is whole on every rank, so backward keeps this rank's slice."""
    return _AllGatherSeq.apply(x, dim, rank, world, group_name)


register(all_gather_seq, "all_gather_seq", "all-gather(seq) forward, local slice backward", (4,),
         identity_alone=True)


def gather_seq(x: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    """Sequence parallel's f: all-gather the sequence forward, reduce-scatter backward."""
    return _GatherSeq.apply(x, dim, world, group_name)


register(gather_seq, "gather_seq", "all-gather(seq) forward, reduce-scatter backward", (3,), identity_alone=True)


def scatter_seq(x: Tensor, dim: int, world: int, group_name: str) -> Tensor:
    """Sequence parallel's g: reduce-scatter along the sequence forward, all-gather backward."""
    return _ScatterSeq.apply(x, dim, world, group_name)


register(scatter_seq, "scatter_seq", "reduce-scatter(seq) forward, all-gather backward", (3,),
         identity_alone=True)


def split_seq(x: Tensor, dim: int, rank: int, world: int, group_name: str) -> Tensor:
    """A replicated activation entering the sequence-split region: keep this rank's slice
    forward, all-gather the gradient backward."""
    return _SplitSeq.apply(x, dim, rank, world, group_name)


register(split_seq, "split_seq", "local slice forward, all-gather backward", (4,), identity_alone=True)


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


register(copy_to_tp, "f", "identity forward, all-reduce(sum) backward", (1,), identity_alone=True)


def reduce_from_tp(x: Tensor, group_name: str) -> Tensor:
    """Megatron's g: leaves a tensor-parallel region (all-reduce in forward)."""
    return _ReduceFromTP.apply(x, group_name)


register(reduce_from_tp, "g", "all-reduce(sum) forward, identity backward", (1,), identity_alone=True)


class _MeanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, group_name):
        ctx.args = (world, group_name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        world, group_name = ctx.args
        return all_reduce(grad, "sum", group_name) / world, None, None


def mean_grad(x: Tensor, world: int, group_name: str) -> Tensor:
    """Identity forward; backward the mean of the ``world`` ranks' gradients, the same bits on
    every rank (an all-reduce gives each rank the same sum)."""
    return _MeanGrad.apply(x, world, group_name)


register(mean_grad, "mean_grad", "identity forward, all-reduce(sum) / world of the gradient backward", (2,),
         identity_alone=True)


def all_reduce_max(x: Tensor, group_name: str) -> Tensor:
    """Max over the group, without gradient (used for a softmax's shift)."""
    return all_reduce(x.detach(), "max", group_name)


register(all_reduce_max, "max", "all-reduce(max) forward, no gradient", (1,), identity_alone=True)


def local_shard(x: Tensor, dim: int, rank: int, world: int) -> Tensor:
    """This rank's slice of a replicated tensor: no communication."""
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)
