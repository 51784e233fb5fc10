"""A 4-process ``fxmegatron train`` job (gloo, pp2 x tp2) in which one rank is SIGKILLed mid-step,
raises inside a pipeline stage, or sleeps forever inside a step, ends within 60 s with a message
naming that rank; ``resume = "auto"`` then continues from the last complete checkpoint and ends
with the losses of a run that never failed, bit for bit."""
import os
import time

import pytest

from tests.trainer_runs import ROOT, TINY, rows, train, write_config

pytestmark = pytest.mark.slow

STEPS, FAULT_STEP, FAULT_RANK = 6, 3, 2
HERE = os.path.join(ROOT, "tests", "fault_injection")


def config(tmp_path, name):
    return write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 1, "watchdog_s": 8.0, "first_step_s": 120.0},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": {"pp": 2, "tp": 2, "microbatches": 2},
        "optim": {"lr": 3e-3},
        "checkpoint": {"every": 2, "keep": 3},
        "log": {"plot": False, "tensorboard": False},
    })


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    r = train(config(tmp, "ref"), 4)
    assert r.returncode == 0, r.stdout
    return [row["loss"] for row in rows(tmp / "ref")]


@pytest.mark.parametrize("fault, says", [
    ("raise", f"rank {FAULT_RANK} failed at step {FAULT_STEP}: RuntimeError: injected fault"),
    ("kill", f"rank {FAULT_RANK}"),
    ("sleep", f"rank {FAULT_RANK} stalled"),
])
def test_fault_ends_the_job_and_resume_continues(reference, tmp_path, fault, says):
    cfg = config(tmp_path, "run")
    mark = tmp_path / "fault_time"
    r = train(cfg, 4, extra_env={"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_FAULT": fault,
                                 "FXM_FAULT_RANK": str(FAULT_RANK), "FXM_FAULT_STEP": str(FAULT_STEP),
                                 "FXM_FAULT_MARK": str(mark)}, timeout=240)
    ended = time.time() - float(mark.read_text())     # from the fault to the end of every process
    assert r.returncode != 0, r.stdout
    assert says in r.stdout, r.stdout
    assert ended < 60, (ended, r.stdout)
    assert len(rows(tmp_path / "run")) == FAULT_STEP, r.stdout
    r2 = train(cfg, 4)
    assert r2.returncode == 0, r2.stdout
    assert "resumed from " + str(tmp_path / "run" / "checkpoints" / "step-00000002") in r2.stdout, r2.stdout
    assert [row["loss"] for row in rows(tmp_path / "run")] == reference
