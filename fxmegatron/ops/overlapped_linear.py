"""Sequence parallelism's collectives overlapped with the matmuls next to them.

Under sequence parallelism every column-parallel linear reads an all-gathered input
and every row-parallel linear's output is reduce-scattered; run one after the other,
the collectives leave the GPU's matmul units idle (a quarter of a tp4 step on four
H200s: docs/PERFORMANCE.md). Here each pair runs as one op cut into ``chunks`` pieces
along the batch (dim 0; the sequence, the dim communicated, is another):

* ``all_gather_linears(x, Ws, bs)`` = ``[linear(all_gather(x), W, b) for W, b]``: every
  chunk's all-gather is queued at once (``async_op``: NCCL runs them on its own stream,
  in order); the matmuls of chunk c wait only for chunk c's gather, so they run while
  chunk c+1 is being gathered. Backward: each chunk's input gradient Σ dY·W is
  reduce-scattered while the next chunk's is computed; the weight gradients, one
  matmul each over the whole batch, run under the last reduce-scatters.
* ``linear_reduce_scatter(y, W)`` = ``reduce_scatter(linear(y, W))``: chunk c's
  reduce-scatter runs while chunk c+1's matmul does. Backward: the all-gathers of the
  output gradient's chunks are queued at once, and each chunk's input gradient is
  computed as soon as its gather lands.

The math is the unchunked one (the same products, summed in the same order per
element), so results match the plain collectives up to matmul tiling. Each op is a
``torch.library`` custom op with an autograd formula, so torch.compile keeps it as a
call. With one chunk, a gather dim of 0, or a batch not divisible by ``chunks``, the
same code runs unchunked. Every rank of the group must use the same ``chunks``.

``transport`` says what moves the pieces: "nccl" (the process group's collectives, async
handles), "copy_engine" (``fxmegatron.ops.copy_engine``: peers pull the pieces from symmetric
buffers with the copy engines, so no SMs are taken from the matmuls), or "auto" (copy
engines where the group has them, else the process group). Over copy engines the pieces
are not batch chunks but the ranks' sequence slices (``chunks`` is not used): a gather
starts with the rank's own slice, which needs no communication, and a reduce-scatter ends
with it, so only the final sum is left after the last matmul. A slice is a strided 3-D view
[outer, rows, features]; its matmul is one batched matmul (``_mm_piece``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fxmegatron.ops import copy_engine
from fxmegatron.ops.groups import nccl_like, resolve_group
from fxmegatron.ops.registry import register

TRANSPORTS = ("auto", "nccl", "copy_engine")


def _chunks(batch: int, dim: int, chunks: int) -> int:
    """How many pieces a batch of ``batch`` rows (gathered or scattered along ``dim``) is cut into."""
    if dim == 0 or chunks <= 1 or batch % chunks:
        return 1
    return chunks


def _gather_async(piece: Tensor, world: int, pg):
    """Start gathering ``piece`` from every rank into [world, *piece.shape]; (buffer, work)."""
    out = piece.new_empty((world,) + tuple(piece.shape))
    if nccl_like(pg):
        return out, dist.all_gather_into_tensor(out, piece, group=pg, async_op=True)
    return out, dist.all_gather(list(out.unbind(0)), piece, group=pg, async_op=True)


def _place_gathered(dst: Tensor, buf: Tensor, dim: int, world: int) -> None:
    """[world, ..., n, ...] -> ``dst`` [..., world * n, ...] (one copy)."""
    dst.unflatten(dim, (world, dst.shape[dim] // world)).copy_(buf.movedim(0, dim))


def _scatter_async(full: Tensor, out: Tensor, dim: int, world: int, pg):
    """Start reduce-scattering ``full`` along ``dim`` into ``out``; returns a wait function."""
    n = full.shape[dim] // world
    pieces = full.unflatten(dim, (world, n)).movedim(dim, 0).contiguous()
    if nccl_like(pg):
        work = dist.reduce_scatter_tensor(out, pieces, group=pg, async_op=True)
        return work.wait
    # gloo has no reduce-scatter: all-reduce, keep this rank's piece (CPU tests)
    work = dist.all_reduce(pieces, group=pg, async_op=True)

    def wait():
        work.wait()
        out.copy_(pieces[dist.get_rank(pg)])
    return wait


def _by_copy_engines(x: Tensor, dim: int, world: int, pg, group_name: str, transport: str) -> bool:
    """Whether this op's collectives go through ``copy_engine`` (``transport`` "auto": where it
    can, i.e. CUDA tensors on an NCCL group with symmetric memory) rather than NCCL/gloo."""
    if transport == "nccl" or pg is None or world == 1 or dim == 0 or dim >= x.dim() - 1:
        return False
    ok = copy_engine.usable(x, pg, group_name)
    if transport == "copy_engine" and not ok:
        raise RuntimeError(f"tp_comm_transport='copy_engine': group {group_name!r} has no symmetric memory "
                           f"for {x.device} tensors (it needs CUDA tensors on an NCCL group)")
    return ok


def _gather_in_pieces(x: Tensor, dim: int, world: int, group_name: str, k: int, transport: str):
    """(gathered, pieces): iterating ``pieces`` yields (sel, piece) as each piece of the gathered
    ``x`` lands; ``sel(t)`` is the same piece of any tensor shaped like the gathered one in all
    but the last dim. Pieces are ``k`` batch pieces (every gather queued at once), or, over
    copy engines, the ranks' sequence slices (this rank's own first: ``copy_engine.ring_gather``)."""
    pg = resolve_group(group_name)
    if _by_copy_engines(x, dim, world, pg, group_name, transport):
        gathered, ring = copy_engine.ring_gather(x, dim, world, pg, group_name)
        return gathered, ((lambda t, q=q: copy_engine.seq_view(t, dim, world, q), g) for q, g in ring)
    shape = list(x.shape)
    shape[dim] *= world
    gathered = x.new_empty(shape)
    if pg is None or world == 1:
        gathered.copy_(x)
        pending = [None] * k
    else:
        pending = [_gather_async(p.contiguous(), world, pg) for p in x.chunk(k)]
    rows = shape[0] // k

    def pieces():
        for c, job in enumerate(pending):
            g = gathered.narrow(0, c * rows, rows)
            if job is not None:
                buf, work = job
                work.wait()
                _place_gathered(g, buf, dim, world)
            yield (lambda t, c=c: t.narrow(0, c * rows, rows)), g
    return gathered, pieces()


def _scatter_in_pieces(like: Tensor, full: List[int], dim: int, world: int, group_name: str, chunks: int,
                       transport: str, produce):
    """(out, wait_all): a ``full``-shaped tensor made piece by piece and reduce-scattered along
    ``dim`` into ``out``. ``produce(sel, part)`` fills ``part`` (contiguous) with the piece that
    ``sel`` cuts from a ``full``-shaped tensor; its reduce-scatter starts at once, under the next
    piece's production; ``wait_all()`` waits. Pieces as in ``_gather_in_pieces``."""
    pg = resolve_group(group_name)
    shape = list(full)
    shape[dim] //= world
    k = _chunks(shape[0], dim, chunks)
    if _by_copy_engines(like, dim, world, pg, group_name, transport):
        return copy_engine.ring_scatter(like, full, dim, world, pg, group_name,
                                        lambda q, part: produce(lambda t: copy_engine.seq_view(t, dim, world, q), part))
    out = like.new_empty(shape)
    rows = full[0] // k
    waits = []
    for c in range(k):
        part = like.new_empty([rows] + list(full[1:]))
        produce(lambda t, c=c: t.narrow(0, c * rows, rows), part)
        piece = out.narrow(0, c * rows, rows)
        if pg is None or world == 1:
            piece.copy_(part)
        else:
            waits.append(_scatter_async(part, piece, dim, world, pg))

    def wait_all():
        for wait in waits:
            wait()
    return out, wait_all


# a matmul of fewer FLOPs than this (~50 us on an H100) takes about as long as the host takes to
# launch it, a few per piece: 1024 x 4096 x 2048 per matrix left the GPU idle 15 ms of a 175 ms
# gpt6.7b tp2 step when launched one matrix at a time
_LOOP_FLOPS = 4e10


def _mm_piece(out: Tensor, a: Tensor, wt: Tensor, bias: Optional[Tensor] = None, accumulate: bool = False) -> None:
    """``out`` = a @ wt (+ bias), or += a @ wt, in place. Contiguous pieces (batch pieces) are
    one 2-D matmul; sequence slices ([outer, rows, last] strided views) one batched matmul
    over ``outer``, the weight broadcast (stride 0), written straight into the strided ``out``
    (a biased one of at least ``_LOOP_FLOPS`` per matrix: one matmul per outer index, each into
    its contiguous matrix)."""
    k, n = wt.shape
    if out.is_contiguous() and a.is_contiguous():
        o2, a2 = out.view(-1, n), a.reshape(-1, k)
        if accumulate:
            o2.addmm_(a2, wt)
        elif bias is None:
            torch.mm(a2, wt, out=o2)
        else:
            torch.addmm(bias, a2, wt, out=o2)
        return
    if bias is not None and not accumulate and 2 * a[0].numel() * n >= _LOOP_FLOPS:
        # baddbmm would first copy the broadcast bias into ``out`` (a pass over it); each
        # outer slice of a sequence piece is a contiguous matrix, whose addmm adds the bias
        # in the GEMM's epilogue: worth its launches where each matrix is large
        for i in range(a.shape[0]):
            torch.addmm(bias, a[i], wt, out=out[i])
        return
    w3 = wt.expand(a.shape[0], k, n)
    if accumulate:
        out.baddbmm_(a, w3)
    elif bias is None:
        torch.bmm(a, w3, out=out)
    else:
        torch.baddbmm(bias, a, w3, out=out)


# ---- all-gather, then column-parallel linears -------------------------------------------------
@torch.library.custom_op("fxmegatron::all_gather_linears", mutates_args=())
def all_gather_linears(x: Tensor, weights: List[Tensor], biases: List[Tensor], has_bias: List[bool], dim: int,
                       world: int, group_name: str, chunks: int, transport: str) -> List[Tensor]:
    """[gathered x] + [linear(gathered x, W, b) for each weight]; ``biases`` holds the biases
    of the weights whose ``has_bias`` is true, in order."""
    it = iter(biases)
    biases = [next(it) if hb else None for hb in has_bias]
    gathered, pieces = _gather_in_pieces(x, dim, world, group_name, _chunks(x.shape[0], dim, chunks), transport)
    outs = [x.new_empty(list(gathered.shape[:-1]) + [w.shape[0]]) for w in weights]
    for sel, g in pieces:
        for w, b, o in zip(weights, biases, outs):
            _mm_piece(sel(o), g, w.t(), b)
    return [gathered] + outs


@all_gather_linears.register_fake
def _(x, weights, biases, has_bias, dim, world, group_name, chunks, transport):
    shape = list(x.shape)
    shape[dim] *= world
    return [x.new_empty(shape)] + [x.new_empty(shape[:-1] + [w.shape[0]]) for w in weights]


@torch.library.custom_op("fxmegatron::all_gather_linears_backward", mutates_args=())
def all_gather_linears_backward(grads: List[Tensor], gathered: Tensor, weights: List[Tensor], has_bias: List[bool],
                                dim: int, world: int, group_name: str, chunks: int, transport: str) -> List[Tensor]:
    """[dx (this rank's sequence piece)] + [dW for each weight] + [db for each weight with a bias]."""

    def input_grad(sel, part):     # sum over the linears of dY @ W, one piece
        for i, (g, w) in enumerate(zip(grads, weights)):
            _mm_piece(part, sel(g), w, accumulate=i > 0)

    dx, wait_all = _scatter_in_pieces(gathered, list(gathered.shape), dim, world, group_name, chunks,
                                      transport, input_grad)
    x2 = gathered.reshape(-1, gathered.shape[-1])     # the weight gradients run under the last reduce-scatters
    dws = [g.reshape(-1, w.shape[0]).t().mm(x2) for g, w in zip(grads, weights)]
    dbs = [g.reshape(-1, g.shape[-1]).sum(0) for g, hb in zip(grads, has_bias) if hb]
    wait_all()
    return [dx] + dws + dbs


@all_gather_linears_backward.register_fake
def _(grads, gathered, weights, has_bias, dim, world, group_name, chunks, transport):
    shape = list(gathered.shape)
    shape[dim] //= world
    return [gathered.new_empty(shape)] + [w.new_empty(w.shape) for w in weights] + \
        [g.new_empty(g.shape[-1:]) for g, hb in zip(grads, has_bias) if hb]


def _agl_setup(ctx, inputs, output):
    x, weights, biases, has_bias, dim, world, group_name, chunks, transport = inputs
    ctx.save_for_backward(output[0], *weights)
    ctx.args = (list(has_bias), dim, world, group_name, chunks, transport, len(weights))


def _agl_backward(ctx, grads):
    gathered, *weights = ctx.saved_tensors
    has_bias, dim, world, group_name, chunks, transport, n = ctx.args
    out_shape = list(gathered.shape[:-1])
    gs = [gathered.new_zeros(out_shape + [w.shape[0]]) if g is None else g.contiguous()
          for g, w in zip(grads[1:], weights)]     # an output the loss does not use
    res = all_gather_linears_backward(gs, gathered, list(weights), has_bias, dim, world, group_name, chunks,
                                      transport)
    return res[0], res[1:1 + n], res[1 + n:], None, None, None, None, None, None


all_gather_linears.register_autograd(_agl_backward, setup_context=_agl_setup)


# ---- row-parallel linear, then reduce-scatter -------------------------------------------------
@torch.library.custom_op("fxmegatron::linear_reduce_scatter", mutates_args=())
def linear_reduce_scatter(y: Tensor, weight: Tensor, dim: int, world: int, group_name: str, chunks: int,
                          transport: str) -> Tensor:
    """reduce_scatter(y @ weight.T) along ``dim``."""
    def product(sel, part):
        _mm_piece(part, sel(y), weight.t())

    out, wait_all = _scatter_in_pieces(y, list(y.shape[:-1]) + [weight.shape[0]], dim, world, group_name,
                                       chunks, transport, product)
    wait_all()
    return out


@linear_reduce_scatter.register_fake
def _(y, weight, dim, world, group_name, chunks, transport):
    shape = list(y.shape[:-1]) + [weight.shape[0]]
    shape[dim] //= world
    return y.new_empty(shape)


@torch.library.custom_op("fxmegatron::linear_reduce_scatter_backward", mutates_args=())
def linear_reduce_scatter_backward(grad: Tensor, y: Tensor, weight: Tensor, dim: int, world: int, group_name: str,
                                   chunks: int, transport: str) -> Tuple[Tensor, Tensor]:
    """(dy, dW): the output gradient all-gathered chunk by chunk, each chunk's dy computed
    as soon as its gather lands; dW in one matmul over the whole gathered gradient."""
    gathered, pieces = _gather_in_pieces(grad, dim, world, group_name, _chunks(grad.shape[0], dim, chunks),
                                         transport)
    dy = y.new_empty(y.shape)
    n = grad.shape[-1]
    for sel, g in pieces:
        _mm_piece(sel(dy), g, weight)
    dw = gathered.reshape(-1, n).t().mm(y.reshape(-1, y.shape[-1]))
    return dy, dw


@linear_reduce_scatter_backward.register_fake
def _(grad, y, weight, dim, world, group_name, chunks, transport):
    return y.new_empty(y.shape), weight.new_empty(weight.shape)


def _lrs_setup(ctx, inputs, output):
    y, weight, dim, world, group_name, chunks, transport = inputs
    ctx.save_for_backward(y, weight)
    ctx.args = (dim, world, group_name, chunks, transport)


def _lrs_backward(ctx, grad):
    y, weight = ctx.saved_tensors
    dy, dw = linear_reduce_scatter_backward(grad.contiguous(), y, weight, *ctx.args)
    return dy, dw, None, None, None, None, None


linear_reduce_scatter.register_autograd(_lrs_backward, setup_context=_lrs_setup)


def gathered_linears(x: Tensor, weights: List[Tensor], biases: List[Optional[Tensor]], dim: int, world: int,
                     group_name: str, chunks: int, transport: str = "auto") -> List[Tensor]:
    """The graph's call: the linears' outputs (the gathered input stays inside)."""
    return all_gather_linears(x.contiguous(), list(weights), [b for b in biases if b is not None],
                              [b is not None for b in biases], dim, world, group_name, chunks, transport)[1:]


register(gathered_linears, "all_gather+linears", "all-gather(seq) then the linears, in batch pieces; backward: "
         "reduce-scatter of the input gradient, in pieces", (5,))


def scattered_linear(y: Tensor, weight: Tensor, dim: int, world: int, group_name: str, chunks: int,
                     transport: str = "auto") -> Tensor:
    """The graph's call: reduce_scatter(linear(y, weight)) along ``dim``."""
    return linear_reduce_scatter(y.contiguous(), weight, dim, world, group_name, chunks, transport)


register(scattered_linear, "linear+reduce_scatter", "linear then reduce-scatter(seq), in batch pieces; backward: "
         "all-gather of the output gradient, in pieces", (4,))
