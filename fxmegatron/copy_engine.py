"""Sequence parallelism's gathers and reduce-scatters moved by the GPU's copy engines.

NCCL's collectives run as kernels: overlapped with the matmuls they feed (``overlapped_linear``)
they take SMs from them (on four H200s the tp4 step's matmuls ran 12% slower under the
overlap: docs/PERFORMANCE.md). Here every rank of the group puts its data in a symmetric
buffer (``torch.distributed._symmetric_memory``: each rank's buffer is mapped into every
peer's address space) and each rank *pulls* what it needs with ``cudaMemcpy2DAsync``, which
the copy engines run, on a side stream; no SM is used but for a one-block barrier and, in the
reduce-scatter, the sum of the pulled pieces.

The tensors are [B, ..., S, ...] split along the sequence dim ``dim`` > 0 and cut into batch
pieces of ``rows`` (the pipelining unit of ``overlapped_linear``). One rank's slice of one
batch piece is then ``height`` blocks of ``width`` contiguous elements, ``pitch`` apart in the
whole tensor: one 2-D copy (``blocks``).

Synchronisation: a barrier after the shards are in place (gather) or after each piece's
partial product is written (reduce-scatter); nothing at the end of an op. Ops alternate
between the two halves of the buffer, so op n + 2 writes where op n was read, and every
peer has finished op n's reads before op n + 1's barrier lets anyone past it (a rank's main
stream waits for its side stream's reads at the end of each op, and every op's barriers
come after that in stream order).
"""
from __future__ import annotations

import ctypes
import math
from typing import Dict, List, NamedTuple, Tuple

import torch
from torch import Tensor


class Blocks(NamedTuple):
    """A 2-D copy, in elements: ``height`` rows of ``width`` elements, from ``src`` (row
    ``i`` at ``src + i * spitch``) to ``dst`` (at ``dst + i * dpitch``)."""
    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int


def blocks(shape: Tuple[int, ...], dim: int, world: int, rank: int, start: int, rows: int,
           gathered_src: bool) -> Blocks:
    """Rank ``rank``'s sequence slice of batch rows [start, start + rows) of a tensor gathered
    along ``dim`` (full ``shape``), against the same rows of the rank's contiguous shard.
    ``gathered_src``: copy from the gathered tensor into a contiguous piece (reduce-scatter);
    else from the shard into the gathered tensor (all-gather). Offsets count from the start of
    the piece in the gathered tensor and from the start of the shard (or piece) buffer."""
    inner = math.prod(shape[dim + 1:])
    s = shape[dim] // world
    width = s * inner
    pitch = shape[dim] * inner
    height = rows * math.prod(shape[1:dim])
    in_full = start * math.prod(shape[1:]) + rank * width
    in_shard = start * math.prod(shape[1:]) // world
    if gathered_src:
        return Blocks(in_shard, width, in_full, pitch, width, height)
    return Blocks(in_full, pitch, in_shard, width, width, height)


_MEMCPY2D = None


def _memcpy2d():
    """cudart's cudaMemcpy2DAsync (the copy engines' strided copy), from the runtime torch
    loaded; None where none loads (then one copy per block)."""
    global _MEMCPY2D
    if _MEMCPY2D is None:
        _MEMCPY2D = False
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                f = ctypes.CDLL(name).cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            _MEMCPY2D = f
            break
    return _MEMCPY2D or None


def copy2d(dst: Tensor, src: Tensor, b: Blocks, stream) -> None:
    """``b`` from the storage of ``src`` to that of ``dst`` (same dtype) on ``stream``."""
    es = dst.element_size()
    f = _memcpy2d()
    if f is not None:
        err = f(dst.data_ptr() + b.dst * es, b.dpitch * es, src.data_ptr() + b.src * es, b.spitch * es,
                b.width * es, b.height, 3, stream.cuda_stream)     # 3: cudaMemcpyDeviceToDevice
        if err:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err} ({b})")
        return
    with torch.cuda.stream(stream):     # no cudart to call: a strided copy kernel
        copy_blocks(dst, src, b)


def copy_blocks(dst: Tensor, src: Tensor, b: Blocks) -> None:
    """``b`` as a torch copy (any device): what ``copy2d`` asks of the copy engines."""
    def rows_of(t, off, pitch):
        return t.as_strided((b.height, b.width), (pitch, 1), t.storage_offset() + off)
    rows_of(dst, b.dst, b.dpitch).copy_(rows_of(src, b.src, b.spitch))


class Workspace:
    """One symmetric buffer per process group, of two halves that ops take in turn; grown (a
    collective rendezvous: every rank of the group asks for the same sizes, as the shapes are
    the same) when an op needs more."""

    def __init__(self, pg, nbytes: int, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self.buf = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buf, pg)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self.peers = [self.handle.get_buffer(r, (2 * nbytes,), torch.uint8, 0) for r in range(self.world)]
        self.nbytes = nbytes
        self.turn = 0

    def take_half(self) -> None:
        """The next op's half (every rank of the group makes the same sequence of ops)."""
        self.turn ^= 1

    def view(self, rank: int, numel: int, dtype: torch.dtype, offset: int = 0) -> Tensor:
        """Elements [offset, offset + numel) of the current half of rank ``rank``'s buffer."""
        es = torch.empty((), dtype=dtype).element_size()
        base = self.turn * self.nbytes
        return self.peers[rank][base + offset * es:base + (offset + numel) * es].view(dtype)

    def barrier(self, channel: int) -> None:
        self.handle.barrier(channel=channel)


_WORKSPACES: Dict[str, Workspace] = {}
_RETIRED: List[Workspace] = []      # outgrown, kept: freeing symmetric memory is not this op's call
_SIDE: Dict[int, "torch.cuda.Stream"] = {}
_USABLE: Dict[str, bool] = {}


def workspace(group_name: str, pg, nbytes: int, device: torch.device) -> Workspace:
    ws = _WORKSPACES.get(group_name)
    if ws is None or ws.nbytes < nbytes:
        if ws is not None:
            _RETIRED.append(ws)
        ws = _WORKSPACES[group_name] = Workspace(pg, max(nbytes, ws.nbytes if ws else 0), device)
    ws.take_half()
    return ws


def side_stream(device: torch.device):
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def usable(x: Tensor, pg, group_name: str) -> bool:
    """Whether the copy-engine transport can serve ``x``'s group: a CUDA tensor, an NCCL
    group, and symmetric memory that rendezvous (tried once per group)."""
    if not x.is_cuda or pg is None:
        return False
    if group_name not in _USABLE:
        import torch.distributed as dist
        try:
            ok = dist.get_backend(pg) == "nccl"
            if ok:
                workspace(group_name, pg, 1 << 20, x.device)
        except Exception:       # no symmetric memory here (driver, build): NCCL serves
            ok = False
        _USABLE[group_name] = ok
    return _USABLE[group_name]


def gather_in_pieces(x: Tensor, dim: int, world: int, pg, group_name: str, k: int):
    """``overlapped_linear._gather_in_pieces`` by copy engines: (gathered, rows, pieces)."""
    shape = list(x.shape)
    shape[dim] *= world
    gathered = x.new_empty(shape)
    rows = shape[0] // k
    ws = workspace(group_name, pg, x.numel() * x.element_size(), x.device)
    main, side = torch.cuda.current_stream(), side_stream(x.device)
    mine = ws.view(ws.rank, x.numel(), x.dtype)
    mine.copy_(x.reshape(-1))
    ws.barrier(0)                       # every shard is in its buffer
    side.wait_stream(main)
    done: List[torch.cuda.Event] = []
    for c in range(k):
        for step in range(world):
            q = (ws.rank + step) % world
            copy2d(gathered, ws.view(q, x.numel(), x.dtype), blocks(tuple(shape), dim, world, q, c * rows, rows, False),
                   side)
        done.append(torch.cuda.Event())
        done[-1].record(side)

    def pieces():
        for c in range(k):
            main.wait_event(done[c])
            yield c, gathered.narrow(0, c * rows, rows)
        main.wait_stream(side)
    return gathered, rows, pieces()


def scatter_in_pieces(like: Tensor, full: List[int], dim: int, world: int, pg, group_name: str, k: int, produce):
    """``overlapped_linear._scatter_in_pieces`` by copy engines: each piece's partial product is
    made in the symmetric buffer; once every rank has made it, each pulls its slice of every
    rank's piece and sums them (one small kernel), while the next piece is made."""
    shape = list(full)
    shape[dim] //= world
    out = like.new_empty(shape)
    rows = full[0] // k
    per_piece = rows * math.prod(full[1:])
    ws = workspace(group_name, pg, k * per_piece * like.element_size(), like.device)
    main, side = torch.cuda.current_stream(), side_stream(like.device)
    numel = k * per_piece      # the buffer holds the pieces in order: the whole product's layout
    for c in range(k):
        produce(c, rows, ws.view(ws.rank, per_piece, like.dtype, c * per_piece).view([rows] + list(full[1:])))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ws.barrier(1)               # every rank's piece c is made
            piece = out.narrow(0, c * rows, rows)
            stage = like.new_empty([world] + list(piece.shape))
            mine = blocks(tuple(full), dim, world, ws.rank, c * rows, rows, True)._replace(dst=0)
            for q in range(world):
                copy2d(stage[q], ws.view(q, numel, like.dtype), mine, side)
            torch.sum(stage, dim=0, out=piece)

    def wait_all():
        main.wait_stream(side)
    return out, wait_all
