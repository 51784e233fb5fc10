"""A weight replicated over tp whose gradient every tp rank computes alone (a mixture's router,
norms without sequence parallelism) gets the ranks' mean, the same bits on every rank: on a GPU
the ranks' kernels round such a gradient differently (atomic adds) and the copies drifted apart
(two H200, a Qwen3-MoE at tp2: router weights 1e-3 apart after 13 steps). Planted here: each
rank's backward scales every replicated weight's gradient by its own factor."""
import pytest

from tests.distributed import run_distributed
from tests.workers.same_grads import replicated_grads


@pytest.mark.parametrize("family, layout, averaged", [
    ("olmoe", dict(sequence_parallel=True), ["model.layers.0.mlp.gate.weight",
                                                   "model.layers.1.mlp.gate.weight"]),
    ("llama", {}, None)], ids=["olmoe-tp2-sp", "llama-tp2"])
def test_replicated_weights_get_the_same_gradient_on_every_tp_rank(family, layout, averaged):
    diffs, names = run_distributed(replicated_grads, 2, family, layout)[0]
    if averaged is not None:    # under sequence parallelism the norms' gradients arrive all-reduced
        assert names == averaged
    else:                       # without it, every norm is read whole on each rank
        assert names and all("norm" in n for n in names), names
    assert diffs and set(names) <= set(diffs)
    assert all(d == 0 for d in diffs.values()), {n: d for n, d in diffs.items() if d}


def test_without_the_pass_the_planted_rounding_parts_the_ranks():
    """The test above can fail: with the pass off, the routers' gradients differ between the ranks."""
    diffs, names = run_distributed(replicated_grads, 2, "olmoe", dict(sequence_parallel=True), False)[0]
    assert names == []
    parted = sorted(n for n, d in diffs.items() if d > 0)
    assert parted == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"], diffs
