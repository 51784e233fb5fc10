"""Tensor parallel on gloo (world 2 and 4), with and without sequence parallelism, with
recompute none / selective / full: loss, gradients and three AdamW steps match the
unmodified model for the bundled GPT, HF GPT-2 and HF Llama (GQA)."""
import pytest

from tests.distributed import run_distributed
from tests.workers import tp_parity

MODELS = ("gpt", "gpt2", "llama")


LAYOUTS = [(w, sp, rc) for w in (2, 4) for sp in (False, True) for rc in ("none", "selective", "full")]


@pytest.fixture(scope="module", params=LAYOUTS,
                ids=[f"tp{w}{'-sp' if sp else ''}-rc_{rc}" for w, sp, rc in LAYOUTS])
def results(request):
    world, sp, rc = request.param
    return world, run_distributed(tp_parity, world, MODELS, 3, {"sequence_parallel": sp, "recompute": rc})


@pytest.mark.parametrize("name", MODELS)
def test_loss_grads_and_adamw_steps_match(results, name):
    world, per_rank = results
    for rank, res in enumerate(per_rank):
        r = res[name]
        first, ref = r["losses"][0], r["losses_ref"][0]
        assert abs(first - ref) <= 1e-5 * abs(ref), (world, rank, first, ref)
        bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
        assert not bad, f"tp={world} rank {rank}: gradients differ: {bad}"
        for a, b in zip(r["losses"], r["losses_ref"]):
            assert abs(a - b) <= 1e-4 * abs(b), (world, rank, r["losses"], r["losses_ref"])
        assert len(r["losses"]) == 3
        # each rank holds a fraction of the weights, not a copy
        assert r["n_local"] < 0.75 * r["n_full"], (r["n_local"], r["n_full"])
