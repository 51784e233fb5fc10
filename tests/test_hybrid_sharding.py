"""Hybrid sharding (HSDP, ``dp_replicate``): the mesh's dp ranks split into replica groups, each
sharding over its own ranks (× cp), the groups replicas of each other. Against the unmodified
model on gloo, fp32: five clipped AdamW steps on different batches with masked labels give its
losses (1e-5), norms and every parameter (1e-4), in every sharded mode; each rank holds its
group's share (1/(dp·cp/dp_replicate)), not the world's. With expert parallelism (an ep group
inside each replica group) an MoE's experts are sharded over the ranks of one group holding the
same experts and summed over the groups: the same steps (a sharded optimizer's state: the
experts' share of those ranks), and under "full" SGD steps with every gradient (1e-4) as
tests/test_expert_parallel.py checks them."""
import pytest

from fxmegatron.errors import ShardingError
from fxmegatron.layout import Layout
from tests.distributed import run_distributed
from tests.test_expert_parallel import check_ep_parity
from tests.test_sharded_dp import _check
from tests.workers.expert_parallel import ep_parity
from tests.workers.sharded_dp import hybrid_groups_once, hybrid_refused, shard_parity

# layout -> (mesh, models, parallelize's keywords)
LAYOUTS = {
    "dp4-r2-full": ({"dp": 4}, ("gpt2",), {"dp_shard": "full"}),
    "dp4-r2-gradients-m2": ({"dp": 4}, ("llama",), {"dp_shard": "gradients", "microbatches": 2}),
    # the pieces over one replica group's cp ranks (one dp rank a group)
    "dp2-cp2-r2-optimizer": ({"dp": 2, "cp": 2}, ("gpt",), {"dp_shard": "optimizer"}),
    # expert parallelism, each replica group of two dp ranks one ep group: every rank of a group
    # holds other experts, their pieces summed over the two groups alone
    "dp4-r2-ep2-optimizer": ({"dp": 4}, ("mixtral",), {"dp_shard": "optimizer", "ep": 2}),
    "dp4-r2-ep2-gradients-m2": ({"dp": 4}, ("qwen2_moe",), {"dp_shard": "gradients", "ep": 2, "microbatches": 2}),
    "dp4-r2-ep2-full": ({"dp": 4}, ("mixtral",), {"dp_shard": "full", "ep": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hybrid_sharded_steps_match(layout):
    dims, names, kw = LAYOUTS[layout]
    world = 1
    for v in dims.values():
        world *= v
    per_rank = run_distributed(shard_parity, world, dims, names, 5, 0.05, {"dp_replicate": 2, **kw})
    _check(per_rank, world)
    shards = dims["dp"] * dims.get("cp", 1) // 2
    # the experts' over the ranks of a group holding the same ones (none but itself at ep = the group)
    expert_shards = max(shards // kw.get("ep", 1), 1)
    for res in per_rank:
        for r in res.values():
            dense, experts = r["whole_numel"] - r["expert_whole"], r["expert_whole"]
            assert r["state_bytes"] <= 12 * (dense / shards + experts / expert_shards + 64 * r["n_params"]), r
            # the group's share, not the world's (the pieces of buckets are not exact halves)
            assert r["state_bytes"] > 12 * (dense / (shards + 1) + experts / (expert_shards + 1)), r


def test_hybrid_sharded_expert_gradients_match():
    """SGD steps at dp4, dp_replicate=2, ep=2, dp_shard="full": each step's whole gradients."""
    dims, names, kw = LAYOUTS["dp4-r2-ep2-full"]
    kw = {**kw, "dp_replicate": 2}
    check_ep_parity(run_distributed(ep_parity, 4, dims, names, kw, 2), dims, kw)


def test_hybrid_sharding_is_refused_where_it_means_nothing():
    with pytest.raises(ShardingError, match=r"dp_replicate=2\) replicates groups that shard .*give dp_shard"):
        Layout(dp=4, dp_replicate=2)
    with pytest.raises(ShardingError, match=r"the 6 data-parallel ranks do not split into 4 equal groups"):
        Layout(dp=6, dp_replicate=4, dp_shard="full")
    # an ep group spans replica groups: the experts' pieces would be summed over ranks holding others
    with pytest.raises(ShardingError, match=r"ep=4, dp_replicate=2\): an ep group must lie inside one replica "
                                            r"group, and ep does not divide .* / 2 groups = 2"):
        Layout(dp=4, dp_replicate=2, ep=4, dp_shard="optimizer")
    Layout(dp=8, dp_replicate=2, ep=2, dp_shard="full")      # two ranks of each group hold the same experts


def test_one_rank_a_group_is_refused_as_plain_data_parallelism():
    for msg in run_distributed(hybrid_refused, 2):
        assert msg is not None and "dp_replicate=2 = dp leaves each group one rank to shard over" in msg, msg


def test_a_mesh_is_split_into_replica_groups_once():
    """parallelize called again on the same mesh (another layout, a benchmark's next row) reuses
    the replica groups instead of creating new communicators every call."""
    for rank, (same, before, after, shard, replica) in enumerate(run_distributed(hybrid_groups_once, 4)):
        assert same and before == after, (same, before, after)
        assert shard == (rank // 2 * 2, rank // 2 * 2 + 1) and replica == (rank % 2, rank % 2 + 2), (rank, shard, replica)
