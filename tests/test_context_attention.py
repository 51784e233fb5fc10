"""Context-parallel attention (``fxmegatron.ops.context_attention``).

One process: the load-balanced layout; the plan as data (every needed chunk pair once, the same
work on every rank at every step, the ring's hops consistent between ranks, both variants doing the
same blocks); the block math against float64; the merge rule against one softmax over the
concatenation; cp = 1; the refusals; and every rank of a layout run as threads of this process.
Multi-process (gloo, fp32, one launch per world size): cp = 2 and 4, both variants, causal and
not, GQA and not, and cp = 2 inside groups whose ranks are not the global ones; output and
gradients against full SDPA at the rank's rows. GPU (bf16, skipped without CUDA): the fused
kernels against math, ranks as threads on one GPU, and NCCL when two GPUs are there.
"""
import itertools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from fxmegatron.ops.attention_blocks import KERNELS, block_backward, block_forward, merge, merge_
from fxmegatron.ops.context_attention import (
    Block, Exchange, Gather, Merge, ReduceScatterGrad, ReturnGrad, Wait, attention_plan, chunks_of,
    cp_attention, describe, load_balanced_index, run_backward, run_forward)
from fxmegatron.ops.groups import SimulatedComm, SimulatedGroup
from tests.distributed import run_distributed
from tests.workers.context_attention import Case, cp_cases, grid, shard_errors

CUDA = torch.cuda.is_available()


def assert_close(errs, where="", out_tol=1e-5, dq_tol=1e-5, dkv_tol=1e-4, relative=False):
    """``errs`` {name: (max |error|, max |reference|)}; relative: tolerances times the latter."""
    for name, (err, ref) in errs.items():
        tol = {"out": out_tol, "dq": dq_tol}.get(name, dkv_tol) * (max(ref, 1.0) if relative else 1.0)
        assert err <= tol, (where, name, err, tol, errs)


# ---- layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balanced_index_covers_every_position_once(cp):
    seq = 8 * cp
    held = [load_balanced_index(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq))
    c = seq // (2 * cp)
    for r, idx in enumerate(held):           # early chunk r, then late chunk 2cp-1-r
        assert idx.dtype == torch.long and len(idx) == 2 * c
        assert idx[0].item() == r * c and idx[c].item() == (2 * cp - 1 - r) * c


def test_load_balanced_index_refuses_a_length_it_cannot_split():
    msg = ("sequence length 1000 is not divisible by 2·cp = 6 "
           "(load-balanced context parallelism: each rank holds two chunks)")
    with pytest.raises(ValueError) as info:
        load_balanced_index(1000, 3, 0)
    assert str(info.value) == msg


# ---- the plan as data -------------------------------------------------------------------------
def blocks(plan):
    return [s for s in plan if isinstance(s, Block)]


def pairs(plan):
    """(q chunk, kv chunk, kind) of every chunk pair the plan's blocks compute: a causal block is
    the lower triangle of its chunks' concatenation (a chunk against itself causal, against an
    earlier one of the block full, against a later one nothing)."""
    out = []
    for blk in blocks(plan):
        for i, a in enumerate(blk.q_chunks):
            for j, b in enumerate(blk.kv_chunks):
                if blk.kind == "full":
                    out.append((a, b, "full"))
                elif i >= j:
                    out.append((a, b, "causal" if i == j else "full"))
    return out


def work(blk):
    """Chunk pairs of work: a causal (diagonal) pair is half of one."""
    return len(blk.q_chunks) * len(blk.kv_chunks) * (0.5 if blk.kind == "causal" else 1.0)


PLANS = [(cp, r, causal, variant) for cp in range(1, 6) for r in range(cp)
         for causal in (True, False) for variant in ("ring", "allgather")]


@pytest.mark.parametrize("cp,rank,causal,variant", PLANS)
def test_plan_computes_every_needed_pair_once(cp, rank, causal, variant):
    got = pairs(attention_plan(cp, rank, causal, variant))
    want = [(a, b) for a in chunks_of(cp, rank) for b in range(2 * cp) if a >= b or not causal]
    assert sorted((a, b) for a, b, _ in got) == sorted(want)          # each exactly once
    for a, b, kind in got:
        assert kind == ("causal" if causal and a == b else "full")
    for blk in blocks(attention_plan(cp, rank, causal, variant)):
        # a causal block's mask is its local lower triangle: right only where local order is global
        assert blk.kind == "full" or (blk.q_chunks == blk.kv_chunks and list(blk.q_chunks) == sorted(blk.q_chunks))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_plan_gives_every_rank_the_same_work_at_every_step(cp):
    for step in range(cp):
        by_rank = {r: sum(work(b) for b in blocks(attention_plan(cp, r, True)) if b.step == step)
                   for r in range(cp)}
        assert by_rank == {r: 2.0 for r in range(cp)}, (step, by_rank)


@pytest.mark.parametrize("cp,causal", [(cp, c) for cp in (2, 3, 4) for c in (True, False)])
def test_ring_hops_agree_between_ranks_and_each_block_is_merged(cp, causal):
    plans = [attention_plan(cp, r, causal, "ring") for r in range(cp)]
    for r, plan in enumerate(plans):
        ex = [s for s in plan if isinstance(s, Exchange)]
        waits = [s for s in plan if isinstance(s, Wait)]
        assert [s.step for s in ex] == [s.step for s in waits] == list(range(cp - 1))
        for e in ex:        # what r sends at step s is what its successor receives at step s
            succ = [s for s in plans[e.send_to] if isinstance(s, Exchange) and s.step == e.step][0]
            assert succ.recv_from == r and succ.recvs_kv_of == e.sends_kv_of == (r - e.step) % cp
        for blk in blocks(plan):
            assert blk.kv_rank == (r - blk.step) % cp
        for w in waits:
            assert w.now_kv_of == (r - w.step - 1) % cp
        for i, s in enumerate(plan):
            if isinstance(s, Block):
                assert plan[i + 1] == Merge(s.step, s.q_chunks)
        assert plan[-1] == ReturnGrad((r + 1) % cp, (r - 1) % cp)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_allgather_does_the_ring_blocks_without_the_hops(cp):
    for r, causal in itertools.product(range(cp), (True, False)):
        ring, ag = attention_plan(cp, r, causal, "ring"), attention_plan(cp, r, causal, "allgather")
        assert blocks(ring) == blocks(ag)
        if cp > 1:
            assert ag[0] == Gather(cp) and ag[-1] == ReduceScatterGrad()
        assert not any(isinstance(s, (Exchange, Wait)) for s in ag)
    assert attention_plan(1, 0, True) == [Block(0, 0, (0, 1), (0, 1), "causal"), Merge(0, (0, 1))]
    assert attention_plan(1, 0, False) == [Block(0, 0, (0, 1), (0, 1), "full"), Merge(0, (0, 1))]


def test_describe_prints_one_line_per_step():
    plan = attention_plan(2, 0, True)
    lines = describe(plan).splitlines()
    assert len(lines) == len(plan)
    assert lines[0] == "step 0: post send kv of rank 0 to rank 1 / recv kv of rank 1 from rank 1"
    assert lines[1] == "step 0: block q[0,3]·kv[0,3] causal (kv of rank 0)"
    assert lines[2] == "step 0: merge into q[0,3]"
    assert "step 1: block q[3]·kv[1,2] full (kv of rank 1)" in lines
    assert lines[-1].startswith("backward: send dK/dV of rank 1's kv home")
    assert describe(attention_plan(2, 0, False, "allgather")).splitlines()[0] == "all-gather kv of ranks 0..1"


def test_plan_refusals():
    with pytest.raises(ValueError, match="variant 'zigzag'"):
        attention_plan(2, 0, True, "zigzag")
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        attention_plan(2, 2, True)


# ---- block math -------------------------------------------------------------------------------
def attention64(q, k, v, causal, scale):
    """Reference in float64: out, lse (GQA by repeating kv heads)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


BLOCKS = [(True, 4, 2, 6, 6), (False, 4, 2, 6, 10), (True, 3, 3, 5, 5), (False, 4, 1, 7, 3)]


@pytest.mark.parametrize("causal,h,hkv,sq,sk", BLOCKS)
def test_block_forward_and_backward_match_float64(causal, h, hkv, sq, sk):
    g = torch.Generator().manual_seed(1)
    q, dout = torch.randn(2, h, sq, 8, generator=g), torch.randn(2, h, sq, 8, generator=g)
    k, v = torch.randn(2, hkv, sk, 8, generator=g), torch.randn(2, hkv, sk, 8, generator=g)
    o, lse = block_forward(q, k, v, causal=causal, scale=0.4)
    ro, rlse = attention64(q, k, v, causal, 0.4)
    assert lse.dtype == torch.float32
    assert (o.double() - ro).abs().max() < 1e-6 and (lse.double() - rlse).abs().max() < 1e-6
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    attention64(*leaves, causal, 0.4)[0].backward(dout.double())
    got = block_backward(dout, q, k, v, o, lse, causal=causal, scale=0.4)
    for a, ref in zip(got, leaves):
        assert a.shape == ref.shape and (a.double() - ref.grad).abs().max() < 1e-5


def test_merge_equals_one_softmax_over_the_concatenation():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64) * 3     # spread-out scores
    v = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64)
    whole_o, whole_lse = attention64(q, k, v, False, 1.0)
    o, lse = torch.zeros_like(whole_o), torch.full_like(whole_lse, float("-inf"))   # the empty partial
    for part in (slice(0, 2), slice(2, 9), slice(9, 12)):
        o, lse = merge(o, lse, *attention64(q, k[:, :, part], v[:, :, part], False, 1.0))
    assert (o.double() - whole_o).abs().max() < 1e-6 and (lse.double() - whole_lse).abs().max() < 1e-6


# ---- the op, one process ----------------------------------------------------------------------
def test_merge_in_place_equals_merge():
    g = torch.Generator().manual_seed(5)
    out, o = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(2))
    lse, lb = (torch.randn(2, 3, 8, generator=g) for _ in range(2))
    want_o, want_l = merge(out, lse, o, lb)
    merge_(out, lse, o, lb)
    torch.testing.assert_close(out, want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, want_l, rtol=1e-6, atol=1e-6)


def test_a_plan_that_skips_rows_is_refused():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    plan = [s for s in attention_plan(1, 0, True) if not isinstance(s, (Block, Merge))]
    with pytest.raises(RuntimeError, match=r"query chunks \[0, 1\] were never computed"):
        run_forward(plan, q, k, v, scale=0.5, transport=SimulatedComm(SimulatedGroup(1), 0))


def test_cp1_is_sdpa():
    q, k, v = (torch.randn(2, h, 8, 4, requires_grad=True) for h in (4, 2, 2))
    out = cp_attention(q, k, v, is_causal=True, scale=None, group=None, cp=1, rank=0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, ref)


def test_cp_attention_refusals():
    x = torch.randn(1, 4, 8, 4)
    kv = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 kv heads"):
        cp_attention(x, kv, kv, is_causal=True, scale=None, group=None, cp=1, rank=0)
    with pytest.raises(ValueError, match="needs the process group"):
        cp_attention(x, x, x, is_causal=True, scale=None, group=None, cp=2, rank=0)
    with pytest.raises(ValueError, match="local sequence 7 is odd"):
        y = torch.randn(1, 4, 7, 4)
        cp_attention(y, y, y, is_causal=True, scale=None, group=None, cp=2, rank=0)
    with pytest.raises(ValueError, match="group has 3 ranks and this is rank 0; the call says cp = 2"):
        cp_attention(x, x, x, is_causal=True, scale=None, group=ThreadRanks(3).transport(0), cp=2, rank=0)


class Mailbox:
    """A posted ring shift between threads: what the sender put in, once it is there."""

    def __init__(self, box):
        self.box = box

    def wait(self):
        return self.box.get(timeout=60)


class ThreadTransport(SimulatedComm):
    """One rank's transport among threads: collectives by fxmegatron's SimulatedGroup; the n-th
    shift a rank posts towards a peer meets the n-th that peer posts from it, as P2P matches."""

    def __init__(self, group, rank, boxes):
        super().__init__(group, rank)
        self.boxes, self.sent, self.posted = boxes, {}, {}

    def shift(self, x, send_to, recv_from):
        n, m = self.sent.get(send_to, 0), self.posted.get(recv_from, 0)
        self.sent[send_to], self.posted[recv_from] = n + 1, m + 1
        self.boxes.get((self.rank, send_to, n)).put(x.clone())
        return Mailbox(self.boxes.get((recv_from, self.rank, m)))


class Boxes:
    """One queue per (sender, receiver, message number), made by whichever side asks first."""

    def __init__(self):
        self.lock, self.queues = threading.Lock(), {}

    def get(self, key):
        with self.lock:
            return self.queues.setdefault(key, queue.Queue())


class ThreadRanks:
    """cp ranks as threads of this process; ``transport(r)`` is what rank r passes as ``group``."""

    def __init__(self, cp):
        self.cp, self.sim, self.boxes = cp, SimulatedGroup(cp, timeout=60), Boxes()

    def transport(self, rank):
        return ThreadTransport(self.sim, rank, self.boxes)

    def run(self, fn):
        """``fn(transport, rank)`` on every rank at once; the results in rank order."""
        with ThreadPoolExecutor(self.cp) as pool:
            futures = [pool.submit(fn, self.transport(r), r) for r in range(self.cp)]
            try:
                return [f.result() for f in futures]
            except BaseException:
                self.sim.abort()
                raise


SIMULATED = [(cp, case) for cp, seq in ((2, 16), (3, 24), (4, 32)) for case in grid(seq)]


@pytest.mark.parametrize("cp,case", SIMULATED, ids=[f"cp{cp}-{c.label()}" for cp, c in SIMULATED])
def test_cp_attention_on_ranks_as_threads(cp, case):
    for autograd in (True, False):
        for errs in ThreadRanks(cp).run(lambda t, r: shard_errors(case, t, cp, r, autograd=autograd)):
            assert_close(errs, case.label())


# ---- the op, multi-process (gloo, fp32) -------------------------------------------------------
def test_cp_attention_gloo_world2():
    cases = grid(16) + [Case("ring", True, 4, 2, 24), Case("allgather", False, 2, 1, 24, scale=0.5)]
    results = run_distributed(cp_cases, 2, cases)
    for res in results:
        assert len(res) == len(cases)
        for key, errs in res.items():
            assert_close(errs, key)


def test_cp_attention_gloo_world4_and_subgroups():
    sub = [Case("ring", True, 4, 2, 24), Case("allgather", True, 4, 2, 24), Case("ring", False, 2, 2, 16)]
    results = run_distributed(cp_cases, 4, grid(32), [[0, 2], [1, 3]], sub)
    for res in results:
        assert len(res) == len(grid(32)) + len(sub)
        for key, errs in res.items():
            assert_close(errs, key)


# ---- GPU (bf16) -------------------------------------------------------------------------------
KERNEL_RAN = "error:fxmegatron attention. the .* kernel refused"    # no silent fallback
@pytest.mark.gpu
@pytest.mark.filterwarnings(KERNEL_RAN)
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal,h,hkv", [(True, 4, 2), (False, 4, 4), (False, 8, 2)])
def test_block_kernels_match_math_in_bf16(causal, h, hkv, kernel, monkeypatch):
    monkeypatch.setenv("FXMEGATRON_CP_KERNELS", kernel)
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, h, 128, 64, generator=g).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(2, hkv, 128, 64, generator=g).cuda().bfloat16() for _ in range(2))
    o, lse = block_forward(q, k, v, causal=causal, scale=0.125)
    assert o.dtype == torch.bfloat16, "the flash kernel did not run (the math path returns fp32)"
    ro, rlse = block_forward(q.float(), k.float(), v.float(), causal=causal, scale=0.125)
    assert (o.float() - ro).abs().max() < 2e-2 and (lse - rlse).abs().max() < 1e-2
    got = block_backward(dout, q, k, v, o, lse, causal=causal, scale=0.125)
    assert got[0].dtype == torch.bfloat16, "the flash backward kernel did not run"
    ref = block_backward(dout.float(), q.float(), k.float(), v.float(), o.float(), lse, causal=causal, scale=0.125)
    for a, b in zip(got, ref):
        assert (a.float() - b).abs().max() <= 3e-2 * max(b.abs().max().item(), 1.0)


GPU_CASES = [(cp, case) for cp, seq in ((2, 256), (4, 512)) for case in grid(seq)]


@pytest.mark.gpu
@pytest.mark.filterwarnings(KERNEL_RAN)
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("cp,case", GPU_CASES, ids=[f"cp{cp}-{c.label()}" for cp, c in GPU_CASES])
def test_cp_attention_bf16_on_ranks_as_threads_on_one_gpu(cp, case):
    case = case._replace(head_dim=64)
    def rank(t, r):
        return shard_errors(case, t, cp, r, "cuda", torch.bfloat16, autograd=False)
    for errs in ThreadRanks(cp).run(rank):
        assert_close(errs, case.label(), 3e-2, 3e-2, 3e-2, relative=True)


@pytest.mark.gpu
@pytest.mark.filterwarnings(KERNEL_RAN)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cp_attention_nccl_world2():
    cases = [c._replace(head_dim=64) for c in grid(256)]
    for res in run_distributed(cp_cases, 2, cases, backend="nccl"):
        for key, errs in res.items():
            assert_close(errs, key, 3e-2, 3e-2, 3e-2, relative=True)


@pytest.mark.parametrize("heads_first", [True, False], ids=["BHSD", "BSHD"])
def test_the_ops_outputs_are_laid_out_as_their_fakes_say(heads_first):
    # inductor trusts the fake's strides: an output laid out otherwise would be read wrongly,
    # silently. q as the projections give it ([B, S, H, D] transposed) or dense [B, H, S, D]
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fxmegatron.ops.context_parallel import _cp_attention, _cp_attention_backward  # noqa: F401
    b, s, h, hkv, d = 1, 8, 4, 2, 8

    def laid(*shape):
        x = torch.randn(b, s, shape[0], d)
        return x.transpose(1, 2).contiguous() if heads_first else x.transpose(1, 2)

    q, k, v = laid(h), laid(hkv), laid(hkv)

    def real(t, r):
        fwd_out, lse = run_forward(attention_plan(2, r, True), q, k, v, scale=0.3, transport=t)
        grads = run_backward(attention_plan(2, r, True), torch.randn_like(fwd_out), q, k, v, fwd_out, lse,
                             scale=0.3, transport=t)
        return [x.stride() for x in (fwd_out, lse, *grads)]

    got = ThreadRanks(2).run(real)[0]
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out, lse = torch.ops.fxmegatron.cp_attention(fq, fk, fv, True, 0.3, "sim:x", 2, 0, "ring")
        grads = torch.ops.fxmegatron.cp_attention_backward(out, fq, fk, fv, out, lse, True, 0.3, "sim:x", 2, 0,
                                                           "ring")
        fake = [x.stride() for x in (out, lse, *grads)]
    assert got == fake
    assert got[0] == q.stride() and got[2] == q.stride()     # out and dq in q's layout: no copies around


def test_block_sums_copy_first_add_after_and_zero_what_nobody_wrote():
    from fxmegatron.ops.attention_blocks import BlockSums
    rows = {0: slice(0, 2), 1: slice(2, 4)}
    sums = BlockSums(torch.full((4, 3), float("nan")), lambda r, ch: (rows[ch],))   # garbage where unwritten
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    sums.add(0, (0,), [((rows[0],), a)])
    sums.add(0, (0,), [((rows[0],), b)])
    assert not sums.complete([(0, 0), (0, 1)])
    got = sums.whole([(0, 0), (0, 1)])
    assert torch.equal(got[:2], a + b) and torch.equal(got[2:], torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="partly summed before"):
        sums.add(0, (0, 1), [((slice(0, 4),), torch.randn(4, 3))])
