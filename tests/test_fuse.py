"""The fuse pass inside the parallel programs (gloo, CPU; the workers inherit
TRITON_INTERPRET=1 from conftest, so fused groups run their generated kernels in the
interpreter): tensor, sequence and pipeline parallel parity with fuse=True, and dropout
fused into kernels drawing the masks of the unfused one-process run."""
import pytest

from tests.distributed import run_distributed
from tests.workers import dropout_runs, pipeline_parity, tp_parity

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

MODELS = ("gpt", "gpt2", "llama")


def test_tp_sp_recompute_with_fuse():
    per_rank = run_distributed(tp_parity, 2, MODELS, 2, {"sequence_parallel": True, "recompute": "full",
                                                          "fuse": True})
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            assert abs(r["losses"][0] - r["losses_ref"][0]) <= 1e-5 * abs(r["losses_ref"][0]), (name, r)
            bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
            assert not bad, (name, rank, bad)


def test_pipeline_with_fuse():
    per_rank = run_distributed(pipeline_parity, 2, 2, ("gpt2", "llama"), [("interleaved", 2, 4)], 4, 8, 2,
                               {"fuse": True})
    for rank, res in enumerate(per_rank):
        for key, r in res.items():
            for a, b in zip(r["losses"], r["losses_ref"]):
                assert abs(a - b) <= 1e-5 * abs(b), (key, rank, r)
            assert not {n: e for n, e in r["grad_err"].items() if e > 1e-4}, (key, rank)


def test_fused_dropout_equals_unfused_single_process():
    """Dropout 0.1 at tp2 with SP, fuse=True: the kernels' Philox masks (bias+dropout+residual,
    lone dropouts; sharded along the sequence) are the unfused run's, so losses and gradients
    equal the one-process run without fusion."""
    per_rank = run_distributed(dropout_runs, 2, ("gpt", "gpt2"), [(True, "none")], 2, 0.1, {"fuse": True})
    for res in per_rank:
        for name, r in res.items():
            single_losses, single_grads = r["single"]
            losses, grads = r[(True, "none")]
            for a, b in zip(losses, single_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (name, losses, single_losses)
            scale = 0.01 * max(g.abs().max().item() for g in single_grads.values())
            for n, g in single_grads.items():
                err = ((grads[n] - g).abs().max() / max(g.abs().max().item(), scale)).item()
                assert err <= 1e-4, (name, n, err)


def test_every_family_fused_is_its_plain_program():
    """fuse=True on every HF family of tests/families.py (one process; the groups run their
    generated kernels): the losses and gradients of two steps on different batches, with
    masked labels, are those of the unfused program. Covers the lone-GeLU groups and the
    bias a linear gives to its GeLU (GPT-NeoX, Falcon, GPT-BigCode, MPT) beyond the models
    they were written for."""
    import copy

    import fxmegatron
    from tests.families import FAMILIES, make_batch
    from tests.helpers import assert_same_two_steps

    for name, fam in FAMILIES.items():
        model = fam.build(n_layer=1)
        plain, fused = (fxmegatron.parallelize(copy.deepcopy(model), None, make_batch(fam, 0), fuse=f)
                        for f in (False, True))
        assert_same_two_steps(name, fam, plain, fused)
