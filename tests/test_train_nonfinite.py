"""A NaN in one rank's gradient stops or skips the step on every rank alike (4 processes, gloo,
dp2 x tp2): ``run.on_nonfinite = "skip"`` gives the losses of a run whose every rank had the
NaN, bit for bit; "stop" ends every rank at that step, naming it. The NaN
(tests/fault_injection/sitecustomize.py) goes, after the gradients are summed over dp, in rank
1's copy of a weight replicated over tp, whose square only tp rank 0 adds to the norm: the
gradient norm of rank 1's tp group must see it, and the other dp replica must hear of it."""
import os

import pytest

from tests.trainer_runs import ROOT, TINY, rows, train, write_config

pytestmark = pytest.mark.slow

STEPS, NAN_STEP = 6, 3
HERE = os.path.join(ROOT, "tests", "fault_injection")


def run(tmp_path, name, policy, rank):
    cfg = write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 1, "watchdog_s": 8.0, "first_step_s": 120.0,
                "on_nonfinite": policy, "log_every": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": {"dp": 2, "tp": 2},
        "optim": {"lr": 3e-3},
        "log": {"plot": False, "tensorboard": False},
    })
    return train(cfg, 4, extra_env={"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_FAULT": "nan",
                                    "FXM_FAULT_RANK": str(rank), "FXM_FAULT_STEP": str(NAN_STEP)}, timeout=240)


def test_a_nan_on_one_rank_is_skipped_on_every_rank(tmp_path):
    everywhere = run(tmp_path, "all", "skip", "all")
    assert everywhere.returncode == 0, everywhere.stdout
    r = run(tmp_path, "one", "skip", 1)
    assert r.returncode == 0, r.stdout
    assert f"step {NAN_STEP}: " in r.stdout and "update skipped" in r.stdout, r.stdout
    want = [(row["step"], row["loss"]) for row in rows(tmp_path / "all")]
    assert [(row["step"], row["loss"]) for row in rows(tmp_path / "one")] == want
    assert len(want) == STEPS and all(row["grad_norm"] != "nan" for row in rows(tmp_path / "one")[NAN_STEP + 1:])


def test_a_nan_on_one_rank_stops_every_rank_at_that_step(tmp_path):
    r = run(tmp_path, "stop", "stop", 1)
    assert r.returncode == 1, r.stdout
    assert f"failed at step {NAN_STEP}: TrainingError: step {NAN_STEP}: " in r.stdout, r.stdout
    assert "non-finite" in r.stdout and f"at step {NAN_STEP + 1}" not in r.stdout, r.stdout
    assert len(rows(tmp_path / "stop")) == NAN_STEP, r.stdout       # no rank logged the step
