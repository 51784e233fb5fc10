"""The copy-engine transport's arithmetic on CPU: its 2-D copies (``blocks``, applied with
torch's strided copies) place every rank's shard where the gather along the sequence dim
puts it; its ring orders take every slice once per step; and the products of sequence
slices, exchanged slot by slot and summed, give the reduce-scatter. (The copies themselves,
cudaMemcpy2DAsync between symmetric buffers, run on GPUs only: benchmarks/end_to_end.py
--check, benchmarks/tp_overlap_ops.py.)"""
import pytest
import torch

from fxmegatron.ops.copy_engine import blocks, copy_blocks, gather_order, scatter_slots, seq_view
from fxmegatron.ops.overlapped_linear import _mm_piece


@pytest.mark.parametrize("shape,dim,world", [((4, 12, 5), 1, 2), ((6, 3, 8, 2), 2, 4), ((2, 9, 7), 1, 3),
                                             ((4, 8), 1, 4)])
def test_gather_blocks_concatenate_shards(shape, dim, world):
    shards = [s.contiguous() for s in torch.randn(shape).chunk(world, dim)]
    gathered = torch.full(shape, float("nan"))
    for q in range(world):
        copy_blocks(gathered, shards[q], blocks(shape, dim, world, q))
    assert torch.equal(gathered, torch.cat(shards, dim))
    for q in range(world):      # and each slice is where seq_view says
        if dim < len(shape) - 1:
            assert torch.equal(seq_view(gathered, dim, world, q).reshape(shards[q].shape), shards[q])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring_orders_cover_every_rank_once_per_step(world):
    # gather: every rank takes every slice once, and at each step each slice is read once
    orders = [gather_order(r, world) for r in range(world)]
    assert all(sorted(o) == list(range(world)) and o[0] == r for r, o in enumerate(orders))
    assert all(sorted(o[step] for o in orders) == list(range(world)) for step in range(world))
    # reduce-scatter: the source of rank r's step t made its partial for r at step t
    for r in range(world):
        slots = scatter_slots(r, world)
        assert sorted([d for d, _ in slots] + [r]) == list(range(world))
        for t, (_, src) in enumerate(slots):
            assert scatter_slots(src, world)[t][0] == r


@pytest.mark.parametrize("shape,dim,world", [((3, 8, 5), 1, 4), ((2, 6, 2, 4), 1, 3), ((1, 4, 3), 1, 2),
                                             ((2, 3, 4, 6), 2, 2)])
@pytest.mark.parametrize("per_matrix", [False, True], ids=["batched", "per-matrix"])
def test_ring_reduce_scatter_and_gather_with_sequence_slices(shape, dim, world, per_matrix, monkeypatch):
    """The ring's pieces as ``overlapped_linear`` makes them: products of sequence slices
    (batched matmuls into strided views), exchanged slot by slot, summed: the reduce-scatter
    of the whole products; and the gathered linear, slice by slice, the linear of the whole
    (a biased piece: one batched matmul, or one matmul per matrix as large pieces are)."""
    import fxmegatron.ops.overlapped_linear as overlapped_linear
    monkeypatch.setattr(overlapped_linear, "_LOOP_FLOPS", 0 if per_matrix else float("inf"))
    torch.manual_seed(0)
    k, n = shape[-1], 7
    ys = [torch.randn(shape) for _ in range(world)]
    ws = [torch.randn(n, k) for _ in range(world)]
    full = list(shape[:-1]) + [n]
    part_shape = seq_view(torch.empty(full), dim, world, 0).shape
    buffers = [[None] * (world - 1) for _ in range(world)]
    for r in range(world):           # every rank makes its partials into its slots
        for t, (dst, _) in enumerate(scatter_slots(r, world)):
            buffers[r][t] = torch.empty(part_shape)
            _mm_piece(buffers[r][t], seq_view(ys[r], dim, world, dst), ws[r].t())
    want = sum(y @ w.t() for y, w in zip(ys, ws)).chunk(world, dim)
    for r in range(world):           # and pulls its slice of every peer's
        own = torch.empty(part_shape)
        _mm_piece(own, seq_view(ys[r], dim, world, r), ws[r].t())
        got = own + sum(buffers[src][t] for t, (_, src) in enumerate(scatter_slots(r, world)))
        assert torch.allclose(got.reshape(want[r].shape), want[r], atol=1e-5)
    # gather then linear, with a bias, slice by slice in ring order, then one more accumulated
    x = ys[0]
    b = torch.randn(n)
    out = torch.full(full, float("nan"))
    for q in gather_order(1 % world, world):
        _mm_piece(seq_view(out, dim, world, q), seq_view(x, dim, world, q), ws[0].t(), b)
    assert torch.allclose(out, x @ ws[0].t() + b, atol=1e-5)
    for q in range(world):
        _mm_piece(seq_view(out, dim, world, q), seq_view(x, dim, world, q), ws[1].t(), accumulate=True)
    assert torch.allclose(out, x @ (ws[0] + ws[1]).t() + b, atol=1e-5)


@pytest.mark.parametrize("fail_allocate,fail_rendezvous,expect", [
    (-1, -1, [(True, True), (True, True)]),
    (1, -1, [(False, False), (False, False)]),      # nobody enters the collective rendezvous
    (-1, 0, [(False, True), (False, True)]),        # everyone falls back together
])
def test_ranks_agree_on_the_copy_engine_set_up(fail_allocate, fail_rendezvous, expect):
    """Were one rank to fail its symmetric-memory allocation and skip the (collective)
    rendezvous, its peers would wait in it for ever; the ranks agree first, then agree again."""
    from tests.distributed import run_distributed
    from tests.workers import copy_engine_agreement
    assert run_distributed(copy_engine_agreement, 2, fail_allocate, fail_rendezvous) == expect
