"""Data parallelism and 3-D meshes on gloo: five AdamW steps give the unmodified model's
losses at (dp, pp, tp) = (2, 2, 2) on 8 processes and (2, 1, 2), (1, 2, 2) on 4; gradients are
reduced in buckets during backward; ZeRO-1 through torch's ZeroRedundancyOptimizer."""
import pytest

import fxmegatron
from tests import models
from tests.distributed import run_distributed
from tests.workers import dp_overlap_and_zero, dp_parity

LAYOUTS = [(2, 2, 2), (2, 1, 2), (1, 2, 2)]
MODELS = ("gpt", "llama")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{d}-pp{p}-tp{t}" for d, p, t in LAYOUTS])
def test_five_adamw_steps_match(layout):
    dp, pp, tp = layout
    kw = {"microbatches": 2} if pp > 1 else {}
    per_rank = run_distributed(dp_parity, dp * pp * tp, layout, MODELS, 5, 4, 8, kw)
    seen = {n: set() for n in MODELS}
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            assert len(r["losses"]) == 5
            for a, b in zip(r["losses"], r["losses_ref"]):
                assert abs(a - b) <= 1e-4 * abs(b), (layout, rank, name, r["losses"], r["losses_ref"])
            bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
            assert not bad, (layout, rank, name, bad)
            seen[name] |= set(r["grad_err"])
    for name in MODELS:
        assert len(seen[name]) == len(list(models.build(name, n_layer=4).parameters()))


def test_buckets_overlap_backward_and_zero1_matches():
    per_rank = run_distributed(dp_overlap_and_zero, 2)
    for r in per_rank:
        for a, b in zip(r["losses"], r["losses_ref"]):
            assert abs(a - b) <= 1e-4 * abs(b), (r["losses"], r["losses_ref"])
        assert r["buckets"] >= 3
        assert r["early"] == r["buckets"]            # every bucket was launched from a grad hook
        # ZeRO-1: each rank keeps AdamW moments for about half of the parameters
        assert r["state_numel"] < 0.75 * 2 * r["param_numel"], r


def test_batch_not_divisible_by_dp_is_named():
    from fxmegatron.compiler import first_microbatch as _first_microbatch
    with pytest.raises(fxmegatron.FxMegatronError, match="which dp=3 does not divide"):
        _first_microbatch(models.batch("gpt", batch_size=8), 1, 3)


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 2)], ids=["dp1-pp2-tp2", "dp2-pp1-tp2"])
def test_clip_grad_norm_is_the_whole_models(layout):
    from tests.workers import clip_parity
    per_rank = run_distributed(clip_parity, layout[0] * layout[1] * layout[2], layout)
    for rank, rows in enumerate(per_rank):
        for loss, loss_ref, n, n_ref in rows:
            assert n_ref > 0.05                                 # the clip is active
            assert abs(n - n_ref) <= 1e-4 * n_ref, (rank, n, n_ref)
            assert abs(loss - loss_ref) <= 1e-4 * loss_ref, (rank, rows)
