"""Activation memory (bytes saved for backward per layer, per rank) at s=256, h=256,
8 heads, b=2, tp=2, measured with saved_tensors_hooks on two gloo processes.

The processes are tests/distributed.py's forked workers running the benchmark's own
``measure`` (what ``activation_memory.run`` runs in each process it spawns): a spawned process
would import torch and fxmegatron again (seconds of CPU each). Rank 0's numbers, as ``run``."""
import pytest

S, H, A, B, T = 256, 256, 8, 2, 2


@pytest.fixture(scope="module")
def measured():
    from activation_memory import measure

    from tests.distributed import run_distributed
    return run_distributed(measure, T, S, H, A, B)[0]


def test_tp_sp_saves_at_most_1_1_over_t(measured):
    # against the user's model, and against the same graph on one process (same attention path)
    assert measured["TP+SP"] <= 1.1 / T * measured["no parallelism"], measured
    assert measured["TP+SP"] <= 1.1 / T * measured["fxmegatron tp=1"], measured


def test_unsplit_graph_matches_the_papers_formula(measured):
    # sbh(34 + 5as/h): unfused attention with 1-byte dropout masks, as the paper counts
    assert abs(measured["fxmegatron tp=1"] / (S * B * H * (34 + 5 * A * S / H)) - 1) < 0.05, measured


def test_sequence_parallel_splits_what_tp_alone_replicates(measured):
    # layer-norm inputs, dropout masks and residuals: 10sbh in the paper, split by SP
    assert measured["TP"] - measured["TP+SP"] >= 0.8 * 10 * S * B * H / T / 2, measured


def test_full_recompute_saves_only_the_block_input(measured):
    block_input = S * B * H // T * 2   # a bf16 sequence shard of [b, s, h]
    assert measured["TP+SP+full"] == block_input, measured


def test_selective_drops_the_attention_core(measured):
    # what stays is the paper's 34sbh/t up to 20%: the s^2 attention terms are gone
    assert measured["TP+SP+selective"] <= 1.2 * 34 * S * B * H / T, measured
    attention_core = 5 * A * S / H * S * B * H / T      # the paper's 5as/h term, per rank
    assert measured["TP+SP"] - measured["TP+SP+selective"] >= 0.9 * attention_core, measured
