"""The copy-engine transport's 2-D copies (``fxmegatron.copy_engine.blocks``), applied with
torch's strided copies on CPU: gathering every rank's shard piece by piece gives the
concatenation along the sequence dim, and pulling each rank's slice of every rank's product
gives what a reduce-scatter sums. (The copies themselves, cudaMemcpy2DAsync between
symmetric buffers, run on GPUs only: benchmarks/end_to_end.py --check.)"""
import pytest
import torch

from fxmegatron.copy_engine import blocks, copy_blocks


@pytest.mark.parametrize("shape,dim,world,k", [((4, 12, 5), 1, 2, 2), ((6, 3, 8, 2), 2, 4, 3),
                                               ((2, 9, 7), 1, 3, 1), ((4, 8), 1, 4, 4)])
def test_gather_blocks_concatenate_shards(shape, dim, world, k):
    shards = list(torch.randn(shape).chunk(world, dim))
    shards = [s.contiguous() for s in shards]
    gathered = torch.full(shape, float("nan"))
    rows = shape[0] // k
    for c in range(k):
        for q in range(world):
            copy_blocks(gathered, shards[q], blocks(shape, dim, world, q, c * rows, rows, gathered_src=False))
    assert torch.equal(gathered, torch.cat(shards, dim))


@pytest.mark.parametrize("shape,dim,world,k", [((4, 12, 5), 1, 2, 2), ((6, 3, 8, 2), 2, 4, 3),
                                               ((4, 8), 1, 4, 2)])
def test_scatter_blocks_pull_each_ranks_slice(shape, dim, world, k):
    products = [torch.randn(shape) for _ in range(world)]     # every rank's full partial product
    rows = shape[0] // k
    for rank in range(world):
        out = torch.zeros(torch.Size(shape[:dim]) + (shape[dim] // world,) + torch.Size(shape[dim + 1:]))
        for c in range(k):
            piece = out.narrow(0, c * rows, rows)
            b = blocks(shape, dim, world, rank, c * rows, rows, gathered_src=True)._replace(dst=0)
            for q in range(world):
                pulled = torch.empty_like(piece)
                copy_blocks(pulled, products[q], b)
                piece += pulled
        assert torch.allclose(out, sum(products).chunk(world, dim)[rank].contiguous(), atol=1e-6)
