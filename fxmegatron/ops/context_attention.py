"""Attention under context parallelism: the sequence is split over ``cp`` ranks, and each rank's
queries meet every rank's keys/values.

Layout (load-balanced, always): the sequence is cut into 2·cp chunks of c tokens; rank r holds
chunks r and 2·cp-1-r, early then late. Under a causal mask query chunk a needs key chunk b fully
if a > b, its diagonal if a == b, not at all if a < b; pairing an early chunk with a late one gives
every rank the same work.

The algorithm is data: ``attention_plan`` lists the steps (exchange, block, merge, wait, ...)
that ``cp_attention`` walks, forward and backward, and ``describe`` prints them. Two variants:

* "ring": K/V travel the ring by P2P, cp-1 hops, each posted before the block it overlaps;
* "allgather" (Llama 3's): all ranks' K/V gathered once, re-gathered in backward (memory over
  traffic), and their gradients reduce-scattered home.

Forward merges the blocks' partial (out, lse) by the online-softmax rule. Backward is not autograd
through that merge: each block's gradient comes from the FINAL out and lse, so blocks add up
independently; in the ring the dK/dV accumulators follow their K/V one hop behind and a last hop
takes them home.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fxmegatron.ops.attention_blocks import BlockSums, block_backward, block_forward, in_q_order, merge_
from fxmegatron.ops.groups import ProcessGroupComm

VARIANTS = ("ring", "allgather")


# ---- layout -----------------------------------------------------------------------------------
def chunks_of(cp: int, rank: int) -> Tuple[int, int]:
    """The two sequence chunks rank ``rank`` holds, in local order (early, late)."""
    return rank, 2 * cp - 1 - rank


def load_balanced_index(seq_len: int, cp: int, rank: int) -> torch.LongTensor:
    """The global positions rank ``rank`` holds, in local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp} "
                         "(load-balanced context parallelism: each rank holds two chunks)")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunks_of(cp, rank)])


# ---- the plan: steps as data ------------------------------------------------------------------
def _chunks(xs: Tuple[int, ...]) -> str:
    return ",".join(map(str, xs))


@dataclass(frozen=True)
class Gather:
    """All-gather every rank's K/V (allgather variant; again in backward)."""
    cp: int

    def line(self) -> str:
        return f"all-gather kv of ranks 0..{self.cp - 1}"


@dataclass(frozen=True)
class Exchange:
    """Post: send the K/V held now on, receive the next; the blocks of this step overlap it."""
    step: int
    send_to: int
    recv_from: int
    sends_kv_of: int
    recvs_kv_of: int

    def line(self) -> str:
        return (f"step {self.step}: post send kv of rank {self.sends_kv_of} to rank {self.send_to}"
                f" / recv kv of rank {self.recvs_kv_of} from rank {self.recv_from}")


@dataclass(frozen=True)
class Block:
    """Attention of query chunks against kv chunks (global chunk ids, local order) of the K/V
    owned by ``kv_rank``. "causal": the same ascending chunks on both sides, masked to the lower
    triangle of their concatenation (a diagonal pair, or a rank's whole shard against itself)."""
    step: int
    kv_rank: int
    q_chunks: Tuple[int, ...]
    kv_chunks: Tuple[int, ...]
    kind: str

    def line(self) -> str:
        return (f"step {self.step}: block q[{_chunks(self.q_chunks)}]·kv[{_chunks(self.kv_chunks)}] "
                f"{self.kind} (kv of rank {self.kv_rank})")


@dataclass(frozen=True)
class Merge:
    """Fold the last block's (out, lse) into these query rows (a no-op in backward)."""
    step: int
    q_chunks: Tuple[int, ...]

    def line(self) -> str:
        return f"step {self.step}: merge into q[{_chunks(self.q_chunks)}]"


@dataclass(frozen=True)
class Wait:
    """Wait for the posted exchange; backward also passes the dK/dV of this step's K/V on."""
    step: int
    now_kv_of: int
    send_to: int
    recv_from: int

    def line(self) -> str:
        return (f"step {self.step}: wait, now hold kv of rank {self.now_kv_of} "
                f"(backward: pass dK/dV on to rank {self.send_to})")


@dataclass(frozen=True)
class ReturnGrad:
    """Backward, ring: the last hop takes dK/dV home; ours arrives from ``recv_from``."""
    send_to: int
    recv_from: int

    def line(self) -> str:
        return (f"backward: send dK/dV of rank {self.send_to}'s kv home to it"
                f" / recv our own from rank {self.recv_from}")


@dataclass(frozen=True)
class ReduceScatterGrad:
    """Backward, allgather: every rank's dK/dV contributions summed on their owner."""

    def line(self) -> str:
        return "backward: reduce-scatter dK/dV to their owners"


Step = Union[Gather, Exchange, Block, Merge, Wait, ReturnGrad, ReduceScatterGrad]


def _kind(a: int, b: int, is_causal: bool) -> Optional[str]:
    if not is_causal or a > b:
        return "full"
    return "causal" if a == b else None


def _blocks(step: int, cp: int, rank: int, kv_rank: int, is_causal: bool) -> List[Block]:
    """The work of query rank ``rank`` against the K/V of ``kv_rank``: one block where the needed
    pairs form a full rectangle or, on a rank's own K/V under a causal mask, the lower triangle of
    its local sequence (its chunks ascend, so local order is global order: one causal kernel call,
    as SDPA on the whole shard); else one block per pair."""
    qs, ks = chunks_of(cp, rank), chunks_of(cp, kv_rank)
    if is_causal and kv_rank == rank:
        return [Block(step, kv_rank, qs, qs, "causal")]
    pairs = [(a, b, _kind(a, b, is_causal)) for a in qs for b in ks]
    pairs = [p for p in pairs if p[2] is not None]
    rows = tuple(a for a in qs if any(p[0] == a for p in pairs))
    cols = tuple(b for b in ks if any(p[1] == b for p in pairs))
    if all(p[2] == "full" for p in pairs) and len(pairs) == len(rows) * len(cols):
        return [Block(step, kv_rank, rows, cols, "full")]
    return [Block(step, kv_rank, (a,), (b,), kind) for a, b, kind in pairs]


def attention_plan(cp: int, rank: int, is_causal: bool, variant: str = "ring") -> List[Step]:
    """The steps rank ``rank`` of ``cp`` walks. Step s works on the K/V of rank (rank - s) % cp,
    in both variants, so they do the same blocks in the same order."""
    if variant not in VARIANTS:
        raise ValueError(f"context-parallel attention variant {variant!r}: expected one of {VARIANTS}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in 0..{cp - 1} (cp = {cp})")
    ring = variant == "ring"
    nxt, prev = (rank + 1) % cp, (rank - 1) % cp
    plan: List[Step] = [] if ring else [Gather(cp)]
    for s in range(cp):
        owner, more = (rank - s) % cp, s < cp - 1
        if ring and more:
            plan.append(Exchange(s, nxt, prev, owner, (owner - 1) % cp))
        for b in _blocks(s, cp, rank, owner, is_causal):
            plan += [b, Merge(s, b.q_chunks)]
        if ring and more:
            plan.append(Wait(s, (owner - 1) % cp, nxt, prev))
    if cp > 1:
        plan.append(ReturnGrad(nxt, prev) if ring else ReduceScatterGrad())
    return plan


def describe(plan: List[Step]) -> str:
    """One readable line per step."""
    return "\n".join(step.line() for step in plan)


# ---- transport --------------------------------------------------------------------------------
class _Posted:
    """A posted send/recv pair; ``wait()`` gives what arrived. Holds the sent tensor until then."""

    def __init__(self, works, sent: Tensor, received: Tensor):
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> Tensor:
        for w in self.works:
            w.wait()
        return self.received


class ProcessGroupTransport:
    """What the executor needs of the cp ranks, over a torch.distributed process group: a ring
    shift by P2P, and all-gather / reduce-scatter (ProcessGroupComm's: NCCL reduce-scatters; on
    gloo it all-reduces and keeps its piece, which is also what gloo's own reduce_scatter_tensor
    does inside; gloo only carries the CPU tests, where the doubled traffic does not matter)."""

    def __init__(self, pg):
        self.pg, self.comm = pg, ProcessGroupComm(pg)
        self.rank, self.size = self.comm.rank, self.comm.size
        # P2P ops name peers by global rank; the plan names them by rank in the group
        self.global_rank = [dist.get_global_rank(pg, r) for r in range(self.size)]

    def shift(self, x: Tensor, send_to: int, recv_from: int) -> _Posted:
        x = x.contiguous()
        received = torch.empty_like(x)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, self.global_rank[send_to], self.pg),
            dist.P2POp(dist.irecv, received, self.global_rank[recv_from], self.pg)])
        return _Posted(works, x, received)

    def all_gather(self, x: Tensor) -> Tensor:
        return self.comm.all_gather(x)

    def reduce_scatter(self, pieces: Tensor) -> Tensor:
        return self.comm.reduce_scatter(pieces)


# ---- the executor -----------------------------------------------------------------------------
def _rows(chunks: Tuple[int, ...], owner: int, cp: int, c: int) -> slice:
    """Where global chunks ``chunks`` of ``owner``'s shard lie in its local sequence."""
    early, late = chunks_of(cp, owner)
    if chunks == (early, late):
        return slice(0, 2 * c)
    return slice(0, c) if chunks == (early,) else slice(c, 2 * c)


def _check_held(block: Block, owner: int) -> None:
    if block.kv_rank != owner:
        raise RuntimeError(f"context-parallel plan out of step: {block.line()} but this rank holds "
                           f"the kv of rank {owner}")


def run_forward(plan: List[Step], q: Tensor, k: Tensor, v: Tensor, *, scale: float,
                transport) -> Tuple[Tensor, Tensor]:
    """Walk ``plan`` forward: (out in q's dtype, lse fp32) of this rank's rows. The first block of
    a row is copied into the fp32 accumulators, later ones merged in place."""
    cp, rank, c = transport.size, transport.rank, q.shape[2] // 2
    # laid out as q (``in_q_order``): the blocks' outputs are, and so are what reads out after
    # (the output projection, through the heads' transpose) and the backward's kernels
    out = in_q_order(q.shape[:3] + v.shape[3:], q, torch.float32)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    written: set = set()                         # query chunks whose rows hold a partial result
    kv, owner = torch.stack([k, v]), rank        # [2, B, Hkv, S_local, D]: one message a hop
    gathered = posted = part = None
    for st in plan:
        if isinstance(st, Gather):
            gathered = transport.all_gather(kv)
        elif isinstance(st, Exchange):
            posted = transport.shift(kv, st.send_to, st.recv_from)
        elif isinstance(st, Block):
            if gathered is None:
                _check_held(st, owner)
            src = kv if gathered is None else gathered[st.kv_rank]
            qr, kr = _rows(st.q_chunks, rank, cp, c), _rows(st.kv_chunks, st.kv_rank, cp, c)
            part = (qr, block_forward(q[:, :, qr], src[0][:, :, kr], src[1][:, :, kr],
                                      causal=st.kind == "causal", scale=scale))
        elif isinstance(st, Merge):
            qr, (o, l) = part
            chunks = set(st.q_chunks)
            if not chunks & written:
                out[:, :, qr].copy_(o)
                lse[:, :, qr].copy_(l)
            elif chunks <= written:
                merge_(out[:, :, qr], lse[:, :, qr], o, l)
            else:
                raise RuntimeError(f"context-parallel plan: {st.line()} covers rows partly merged before")
            written |= chunks
        elif isinstance(st, Wait):
            kv, owner = posted.wait(), st.now_kv_of
    if written != set(chunks_of(cp, rank)):
        raise RuntimeError(f"context-parallel plan of rank {rank}: query chunks "
                           f"{sorted(set(chunks_of(cp, rank)) - written)} were never computed")
    return out.to(q.dtype), lse


def run_backward(plan: List[Step], dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 lse: Tensor, *, scale: float, transport) -> Tuple[Tensor, Tensor, Tensor]:
    """Walk ``plan`` backward from ``run_forward``'s out and lse: dq, and dk, dv of this rank's
    own K/V (every rank's contributions summed)."""
    cp, rank, c = transport.size, transport.rank, q.shape[2] // 2
    # fp32 sums whose chunks of rows the first block writes and the others add to (no zeros filled
    # and read back: ``BlockSums``); dq laid out as q, as the projections' backward reads it
    q_rows = lambda r, ch: (slice(None),) * 2 + (_rows((ch,), r, cp, c),)            # noqa: E731
    _keys = lambda ranks: [(r, ch) for r in ranks for ch in chunks_of(cp, r)]          # noqa: E731
    dq = BlockSums(in_q_order(q.shape, q, torch.float32), q_rows)
    kv, owner = torch.stack([k, v]), rank
    kv_rows = lambda r, ch: (slice(None),) * 3 + (_rows((ch,), r, cp, c),)          # noqa: E731
    dkv = BlockSums(torch.empty(kv.shape, dtype=torch.float32, device=q.device), kv_rows)   # of the K/V held now
    gathered = posted = grads_in = None
    for st in plan:
        if isinstance(st, Gather):
            gathered = transport.all_gather(kv)
            dkv = BlockSums(torch.empty(gathered.shape, dtype=torch.float32, device=q.device),
                            lambda r, ch: (r,) + kv_rows(r, ch))
        elif isinstance(st, Exchange):
            posted = transport.shift(kv, st.send_to, st.recv_from)
        elif isinstance(st, Block):
            if gathered is None:
                _check_held(st, owner)
            src = kv if gathered is None else gathered[st.kv_rank]
            qr, kr = _rows(st.q_chunks, rank, cp, c), _rows(st.kv_chunks, st.kv_rank, cp, c)
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, qr], q[:, :, qr], src[0][:, :, kr], src[1][:, :, kr], out[:, :, qr],
                lse[:, :, qr], causal=st.kind == "causal", scale=scale)
            dq.add(rank, st.q_chunks, [((slice(None),) * 2 + (qr,), dq_b)])
            lead = () if gathered is None else (st.kv_rank,)
            dkv.add(st.kv_rank, st.kv_chunks, [(lead + (i, slice(None), slice(None), kr), d)
                                               for i, d in enumerate((dk_b, dv_b))])
        elif isinstance(st, Wait):
            # what the ranks before us gathered for the K/V we just worked on joins ours and goes
            # on; its transfer overlaps the next step's blocks
            done = dkv.whole(_keys([owner]))
            kv, owner = posted.wait(), st.now_kv_of
            if grads_in is not None:
                done += grads_in.wait()
            grads_in = transport.shift(done, st.send_to, st.recv_from)
            dkv = BlockSums(torch.empty_like(done), kv_rows)
        elif isinstance(st, ReturnGrad):
            done = dkv.whole(_keys([owner]))
            if grads_in is not None:
                done += grads_in.wait()
            dkv = BlockSums(transport.shift(done, st.send_to, st.recv_from).wait(), kv_rows, whole=True)
        elif isinstance(st, ReduceScatterGrad):
            dkv = BlockSums(transport.reduce_scatter(dkv.whole(_keys(range(cp)))), kv_rows, whole=True)
    if not dq.complete(_keys([rank])):
        raise RuntimeError(f"context-parallel plan of rank {rank}: some query chunks got no gradient")
    dkv = dkv.whole(_keys([rank]))
    return dq.t.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, transport):
        out, lse = run_forward(plan, q, k, v, scale=scale, transport=transport)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.transport = plan, scale, transport
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(ctx.plan, dout, q, k, v, out, lse, scale=ctx.scale, transport=ctx.transport)
        return dq, dk, dv, None, None, None


# ---- the op -----------------------------------------------------------------------------------
def _check(q: Tensor, k: Tensor, v: Tensor, cp: int, rank: int, variant: str) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"context-parallel attention takes q, k, v as [B, heads, S_local, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] \
            or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match "
                         "(same batch and local sequence; q and k the same head dim)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"local sequence {q.shape[2]} is odd: a load-balanced shard is two equal chunks")
    if variant not in VARIANTS:
        raise ValueError(f"context-parallel attention variant {variant!r}: expected one of {VARIANTS}")
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in 0..{cp - 1} (cp = {cp})")


def cp_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float],
                 group, cp: int, rank: int, variant: str = "ring") -> Tensor:
    """SDPA (``enable_gqa=True``) of the whole sequence, restricted to this rank's rows, all in
    the load-balanced local layout: q [B, H, S_local, D]; k, v [B, Hkv, S_local, D].

    ``group``: the cp ranks' ProcessGroup (group rank = ``rank``), None when cp == 1; or an
    object with ProcessGroupTransport's rank, size, shift, all_gather and reduce_scatter (how
    ranks simulated in one process run it). Differentiable in q, k, v."""
    _check(q, k, v, cp, rank, variant)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
    if group is None:
        raise ValueError(f"cp = {cp} needs the process group of the cp ranks (got None)")
    transport = group if hasattr(group, "shift") else ProcessGroupTransport(group)
    if (transport.size, transport.rank) != (cp, rank):
        raise ValueError(f"the group has {transport.size} ranks and this is rank {transport.rank}; "
                         f"the call says cp = {cp}, rank = {rank}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)    # SDPA's default
    plan = attention_plan(cp, rank, is_causal, variant)
    return _ContextAttention.apply(q, k, v, plan, scale, transport)
