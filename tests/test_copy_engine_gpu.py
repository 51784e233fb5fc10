"""The copy-engine transport on real GPUs (NCCL, symmetric memory): the overlapped linears match
the same ops over NCCL in fp32, forward and backward. Skipped without two CUDA GPUs."""
import pytest
import torch

from tests.distributed import run_distributed
from tests.workers import copy_engine_vs_nccl


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_matches_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = run_distributed(copy_engine_vs_nccl, world, backend="nccl")
    if not all(usable for usable, _ in results):
        pytest.skip("no symmetric memory for this group (driver or build)")
    assert max(err for _, err in results) < 1e-5, results
