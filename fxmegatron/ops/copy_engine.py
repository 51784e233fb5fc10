"""Sequence parallelism's gathers and reduce-scatters moved by the GPU's copy engines.

NCCL's collectives run as kernels: overlapped with the matmuls they feed (``overlapped_linear``)
they take SMs from them (on four H200s the tp4 step's matmuls ran 12% slower under the
overlap: docs/PERFORMANCE.md). Here every rank of the group puts its data in a symmetric
buffer (``torch.distributed._symmetric_memory``: each rank's buffer is mapped into every
peer's address space) and each rank *pulls* what it needs with ``cudaMemcpy2DAsync``, which
the copy engines run, on a side stream; no SM is used but for a one-block barrier and the
reduce-scatter's final sum.

Both collectives go round the ranks' sequence slices (the tensors are [B, ..., S, ..., H],
split along the sequence dim ``dim``; a slice is a 3-D view, ``seq_view``):

* gather (``ring_gather``): a rank's own slice is its input, so its matmul runs first with no
  wait; meanwhile the shard goes into the buffer, a barrier, and the peers' shards are pulled
  one after another, rank + 1 first (at each step every GPU is read by one peer), each a 2-D
  copy into the gathered tensor (``blocks``), each slice's matmul as soon as it lands;
* reduce-scatter (``ring_scatter``): at step t a rank makes the partial product of rank
  + 1 + t's slice into slot t of its buffer; after a barrier, each rank pulls slot t of the
  rank that made its partial at that step (``scatter_slots``), under the next step's matmul;
  its own slice is made last, and the W pieces are summed.

Synchronisation: one barrier per gather, one per reduce-scatter step, nothing at the end of an
op. Ops alternate between the two halves of the buffer, so op n + 2 writes where op n was
read, and every peer has finished op n's reads before op n + 1's barrier lets anyone past it
(a rank's main stream waits for its side stream at the end of each op; an op's barriers and
buffer writes come after that in stream order).
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


def blocks(shape: Tuple[int, ...], dim: int, world: int, rank: int) -> Blocks:
    """Rank ``rank``'s sequence slice of a tensor gathered along ``dim`` (full ``shape``), from
    the rank's contiguous shard: one block per index of the dims before ``dim``."""
    inner = math.prod(shape[dim + 1:])
    width = shape[dim] // world * inner
    return Blocks(rank * width, shape[dim] * inner, 0, width, width, math.prod(shape[:dim]))


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

    def __init__(self, pg, nbytes: int, device: torch.device, buf: Tensor = None):
        from torch.distributed import _symmetric_memory as symm_mem

        self.buf = symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=device) if buf is None else buf
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


# Keyed by the resolved group's name and ranks: a later mesh in the same process may reuse
# a group name for other ranks.
_WORKSPACES: Dict[Tuple[str, Tuple[int, ...]], Workspace] = {}
_RETIRED: List[Workspace] = []      # outgrown, kept: freeing symmetric memory is not this op's call
_SIDE: Dict[int, "torch.cuda.Stream"] = {}
_USABLE: Dict[Tuple[str, Tuple[int, ...]], bool] = {}


def _key(group_name: str, pg) -> Tuple[str, Tuple[int, ...]]:
    import torch.distributed as dist

    return getattr(pg, "group_name", group_name), tuple(dist.get_process_group_ranks(pg))


def workspace(group_name: str, pg, nbytes: int, device: torch.device) -> Workspace:
    key = _key(group_name, pg)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.nbytes < nbytes:
        if ws is not None:
            _RETIRED.append(ws)
        ws = _WORKSPACES[key] = Workspace(pg, max(nbytes, ws.nbytes if ws else 0), device)
    ws.take_half()
    return ws


def side_stream(device: torch.device):
    """The stream the pulls run on. One: on a stream per peer the ops ran slower on four H200s
    (benchmarks/tp_overlap_ops.py: 0.3-0.7 ms more per op forward), though the copies ran at once."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def usable(x: Tensor, pg, group_name: str) -> bool:
    """Whether the copy-engine transport can serve ``x``'s group: a CUDA tensor, an NCCL
    group, and symmetric memory that every rank of the group could allocate and rendezvous
    (tried once per group; the ranks agree, ``agree_to_set_up``)."""
    if not x.is_cuda or pg is None:
        return False
    key = _key(group_name, pg)
    if key not in _USABLE:
        import torch.distributed as dist
        if dist.get_backend(pg) != "nccl":      # the same answer on every rank
            _USABLE[key] = False
        else:
            from torch.distributed import _symmetric_memory as symm_mem
            nbytes = 1 << 20

            def finish(buf):
                ws = Workspace(pg, nbytes, x.device, buf)
                ws.take_half()
                _WORKSPACES[key] = ws
            _USABLE[key] = agree_to_set_up(
                pg, x.device, lambda: symm_mem.empty(2 * nbytes, dtype=torch.uint8, device=x.device), finish)
    return _USABLE[key]


def agree_to_set_up(pg, device, allocate, rendezvous) -> bool:
    """Run ``rendezvous(allocate())`` on every rank of ``pg`` or on none, and say whether every
    rank succeeded. A rendezvous is collective: were one rank to fail its allocation (no
    symmetric memory in this driver or build, out of memory) and skip it, its peers would
    wait in it for ever. So the ranks first agree (an all-reduce of the minimum) that all
    allocated; then, after the rendezvous, that all got through it. On False every rank
    falls back to the process group's collectives."""
    import torch.distributed as dist

    def everyone(ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
        return bool(t.item())

    try:
        buf = allocate()
    except Exception:
        buf = None
    if not everyone(buf is not None):
        return False
    try:
        rendezvous(buf)
        ok = True
    except Exception:
        ok = False
    return everyone(ok)


def seq_view(t: Tensor, dim: int, world: int, q: int) -> Tensor:
    """Rank ``q``'s sequence slice of the contiguous full tensor ``t`` (split along ``dim``, not
    the last), as a 3-D view [outer, rows, last]: ``outer`` blocks of ``rows`` contiguous rows."""
    shape = t.shape
    rows = shape[dim] // world * math.prod(shape[dim + 1:-1])
    return t.view(math.prod(shape[:dim]), world * rows, shape[-1]).narrow(1, q * rows, rows)


def gather_order(rank: int, world: int) -> List[int]:
    """The order rank ``rank`` takes the ranks' slices in: its own (no wait), then the peers
    from the next one on, so that at each step every GPU is read by one peer."""
    return [(rank + step) % world for step in range(world)]


def scatter_slots(rank: int, world: int) -> List[Tuple[int, int]]:
    """(destination, source) per step of rank ``rank``'s reduce-scatter: at step t it makes the
    partial for ``destination`` (into buffer slot t) and pulls slot t of ``source``, which made
    its partial for this rank at the same step. Its own slice is made last, after them."""
    return [((rank + 1 + t) % world, (rank - 1 - t) % world) for t in range(world - 1)]


def ring_gather(x: Tensor, dim: int, world: int, pg, group_name: str):
    """(gathered, pieces): ``x`` all-gathered along ``dim``, in the ranks' sequence slices.
    ``pieces`` yields (q, slice q) starting with this rank's own (``x`` itself: no wait), then
    rank + 1, rank + 2, ... as each lands: at each step every GPU is read by one peer."""
    shape = list(x.shape)
    shape[dim] *= world
    gathered = x.new_empty(shape)
    ws = workspace(group_name, pg, x.numel() * x.element_size(), x.device)
    main, side = torch.cuda.current_stream(x.device), side_stream(x.device)
    rank = ws.rank
    side.wait_stream(main)
    whole = Blocks(0, x.numel(), 0, x.numel(), x.numel(), 1)
    copy2d(ws.view(rank, x.numel(), x.dtype), x, whole, side)
    with torch.cuda.stream(side):
        ws.barrier(0)                   # every shard is in its buffer
    order = gather_order(rank, world)
    landed = {}
    for q in order[1:]:
        copy2d(gathered, ws.view(q, x.numel(), x.dtype), blocks(tuple(shape), dim, world, q), side)
        landed[q] = torch.cuda.Event()
        landed[q].record(side)
    copy2d(gathered, x, blocks(tuple(shape), dim, world, rank), side)

    def pieces():
        try:
            yield rank, x.view(seq_view(gathered, dim, world, rank).shape)
            for q in order[1:]:
                main.wait_event(landed[q])
                yield q, seq_view(gathered, dim, world, q)
        finally:    # also when the consumer stops early: ``gathered`` and ``x`` outlive the copies
            main.wait_stream(side)
    return gathered, pieces()


def ring_scatter(like: Tensor, full: List[int], dim: int, world: int, pg, group_name: str, produce):
    """(out, wait_all): a ``full``-shaped product reduce-scattered along ``dim``, made one
    destination's sequence slice at a time: ``produce(q, part)`` writes slice q's partial
    product into ``part`` ([outer, rows, last], contiguous). Rank r makes r + 1's slice first
    (into its buffer, pulled by r + 1 under the next step), ..., its own last; the own slice
    and the pulled ones are summed at the end."""
    shape = list(full)
    shape[dim] //= world
    out = like.new_empty(shape)
    part_shape = [math.prod(shape[:dim]), math.prod(shape[dim:-1]), shape[-1]]
    per = math.prod(part_shape)
    ws = workspace(group_name, pg, max(world - 1, 1) * per * like.element_size(), like.device)
    main, side = torch.cuda.current_stream(like.device), side_stream(like.device)
    rank = ws.rank
    stage = like.new_empty([world] + part_shape)
    piece = Blocks(0, per, 0, per, per, 1)
    for t, (dst, src) in enumerate(scatter_slots(rank, world)):
        produce(dst, ws.view(rank, per, like.dtype, t * per).view(part_shape))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ws.barrier(1)           # every rank's slot t is made
        copy2d(stage[t], ws.view(src, per, like.dtype, t * per), piece, side)
    produce(rank, stage[world - 1])
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if world == 2:      # an elementwise add streams at bandwidth; sum over dim 0 did not
            torch.add(stage[0], stage[1], out=out.view(part_shape))
        else:
            torch.sum(stage, dim=0, out=out.view(part_shape))

    def wait_all(stage=stage):
        # ``stage`` lives until here: freed when this function returned, the allocator would
        # hand its memory to the caller's next tensor on the main stream (the weight
        # gradients, in the linears' backward) while the side stream still pulls into it and
        # sums it. (That race, found by end_to_end.py --check at tp2, gave wrong gradients.)
        main.wait_stream(side)
    return out, wait_all

