"""The copy-engine transport on real GPUs (NCCL, symmetric memory): the overlapped linears in fp32,
forward and backward, are as close to the same ops in fp64 as NCCL's fp32 are. Skipped without two
CUDA GPUs."""
import pytest
import torch

from tests.distributed import run_distributed
from tests.workers import copy_engine_vs_nccl


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_matches_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_distributed(copy_engine_vs_nccl, world, backend="nccl")
    if not all(usable for usable, _, _ in results):
        pytest.skip("no symmetric memory for this group (driver or build)")
    ce, nccl = max(r[1] for r in results), max(r[2] for r in results)
    # a race or a wrong slot gives errors of order 1; rounding differs by summation order only
    assert ce <= 4 * nccl + 1e-6 and ce < 1e-3, results
