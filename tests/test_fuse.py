"""The fuse pass inside the parallel programs (gloo, CPU: fused groups run as their ATen ops
here; the generated kernels are tested in test_codegen.py): tensor, sequence and pipeline
parallel parity with fuse=True."""
from tests.distributed import run_distributed
from tests.workers import pipeline_parity, tp_parity

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
