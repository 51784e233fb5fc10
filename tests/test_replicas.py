"""Data-parallel replicas (and the tp ranks of a replicated parameter, and the pipeline ranks of
a tied weight) built with different weights are refused by parallelize, naming the parameter and
the ranks: trained on, they would stay different for ever while the dp-averaged loss hides it."""
from tests.distributed import run_distributed
from tests.workers.replicas import different_weights


def test_ranks_given_different_weights_are_refused():
    per_rank = run_distributed(different_weights, 2)
    assert per_rank[0] == per_rank[1]       # every rank raises the same error: none waits in a collective
    same_seed, dp, tp, pp, full, full_same = per_rank[0]
    assert same_seed is None
    assert dp.startswith("parameter 'wte.weight' differs between the data-parallel replicas: global rank(s) [0] "
                         "hold one value and [1] another"), dp
    assert "torch.manual_seed(S)" in dp
    assert tp.startswith("parameter 'blocks.1.ln2.weight' differs between the tp ranks (it is replicated over tp): "
                         "global rank(s) [0] hold one value and [1] another"), tp
    assert pp.startswith("parameter 'wte.weight' differs between the pipeline ranks holding a copy of this tied "
                         "weight"), pp
    assert full == dp and full_same is None     # fully sharded: the shards differ, the whole pieces must not
