"""``dp_shard="full"`` (ZeRO-3): every parameter a flat shard per data-parallel rank, each block's
gathered by one ``unshard`` node before the block and its gradients reduce-scattered by autograd.
Against the unmodified model on gloo, fp32: five clipped AdamW steps on different batches with
masked labels give its losses (1e-5), norms and every parameter (1e-4); each rank holds about
1/world of the parameters and of the optimizer's fp32 state; the gathers happen where the
recomputation (or the compiled backward) needs them again."""
import pytest

from fxmegatron.errors import ShardingError
from fxmegatron.layout import Layout
from tests.distributed import run_distributed
from tests.test_sharded_dp import _check
from tests.workers.sharded_dp import gather_counts, shard_parity

# layout -> (mesh, models, parallelize's keywords): three HF families (tied; untied GQA, compiled; the MoE under tp) and
# the bundled GPT, with tp + sp, cp, recompute (and two microbatches: the shards' gradients
# accumulate) and compile
LAYOUTS = {
    "dp2": ({"dp": 2}, ("gpt2",), {}),
    "dp4-recompute-m2": ({"dp": 4}, ("gpt",), {"recompute": "full", "microbatches": 2}),
    "dp2-tp2-sp": ({"dp": 2, "tp": 2}, ("gpt", "mixtral"), {"sequence_parallel": True}),
    "dp2-cp2": ({"dp": 2, "cp": 2}, ("gpt2",), {}),
    "dp2-compile": ({"dp": 2}, ("llama",), {"compile": True}),
    # interleaved: GPT-2's tied embedding and head on two stages, each gathered in its own chunk
    "dp2-pp2-v2": ({"dp": 2, "pp": 2}, ("gpt2",), {"microbatches": 4, "virtual_stages": 2}),
    # expert parallelism: the experts sharded over the ranks holding the same ones (none at dp = ep:
    # whole there; two at dp4 ep2), the rest over dp; the norm from every rank's shards
    "dp2-ep2": ({"dp": 2}, ("qwen2_moe",), {"ep": 2}),
    "dp4-ep2": ({"dp": 4}, ("mixtral",), {"ep": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fully_sharded_steps_match(layout):
    dims, names, kw = LAYOUTS[layout]
    world = 1
    for v in dims.values():
        world *= v
    shards = dims["dp"] * dims.get("cp", 1)
    per_rank = run_distributed(shard_parity, world, dims, names, 5, 0.05, {"dp_shard": "full", **kw})
    _check(per_rank, world)
    edp = shards // kw.get("ep", 1)     # the ranks an expert weight (its E/ep experts) is sharded over
    for res in per_rank:
        for r in res.values():
            # this rank's parameters: 1/(dp·cp) of its whole (tp) pieces (its experts' 1/edp), and padding
            # to 64 elements a shard
            want = (r["whole_numel"] - r["expert_whole"]) / shards + r["expert_whole"] / edp
            assert r["param_numel"] <= want + 64 * r["n_params"], r
            assert r["param_numel"] >= want, r
            assert r["state_bytes"] == 12 * r["param_numel"], r      # fp32 master, m, v of the shards only


@pytest.mark.parametrize("kw", [{}, {"recompute": "full"}, {"compile": True}])
def test_a_block_is_gathered_once_forward_and_again_for_the_backward(kw):
    for r in run_distributed(gather_counts, 2, kw):
        assert r["nodes"] == r["groups"], r           # one unshard per block and per parameter outside blocks
        assert r["forward"] == r["groups"], r         # eval: each group gathered once
        # a step gathers every group in the forward, and again each block and each parameter outside
        # blocks whose backward reads it (a recomputed block, the compiled backward, or, eager, what
        # autograd saved of it: regather_in_backward), not those it does not (wpe, ln_f.bias)
        assert r["groups"] + r["blocks"] <= r["step"] < 2 * r["groups"], r
        if not kw.get("compile"):       # eager: at most two groups whole at once (compiled: not seen from Python)
            assert r["peak_whole"] <= 2 * r["largest_group"], r
        else:       # compiled: the gathers are torch's functional collectives, which inductor can schedule
            assert r["opaque_gathers"] == 0, r


def test_full_sharding_is_refused_where_not_built():
    with pytest.raises(ShardingError, match=r"chunked \(compiled-folder\) program: not built yet"):
        Layout(dp=2, dp_shard="full", chunked=True)
    with pytest.raises(ShardingError, match=r"dp_shard='full', precision='fp8'\): not tested together yet"):
        Layout(dp=2, dp_shard="full", precision="fp8")
    with pytest.raises(ShardingError, match=r"dp_shard='full', tp_comm_overlap=2\): not tested together yet"):
        Layout(dp=2, tp=2, dp_shard="full", sequence_parallel=True, tp_comm_overlap=2)
