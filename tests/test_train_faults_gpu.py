"""tests/test_train_faults.py's faults on a 2-GPU NCCL job (skipped without two CUDA GPUs), at
tp2 and at pp2: rank 1 raises in its forward, sleeps forever there, or is SIGKILLed there
during step 3; every process ends within 60 s of the fault with the rank named, and
``resume = "auto"`` continues to the uninterrupted run's losses bit for bit. Also SIGTERM
(every rank saves the step it agreed on, status 0, the resume bitwise) and a NaN in rank 1's
copy of a weight replicated over tp (tp2: "skip" gives the losses of a run whose every rank had
the NaN; "stop" ends both ranks at that step). Under NCCL a rank blocked on a dead peer does not
return from the collective: only the watchdog (and torchrun's SIGKILL after its shutdown
timeout) ends it, which is what these runs check. Faults: tests/fault_injection/sitecustomize.py."""
import os
import re
import time

import pytest
import torch

from tests.trainer_runs import ROOT, TINY, rows, train, write_config

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

STEPS, FAULT_STEP, FAULT_RANK = 6, 3, 1
HERE = os.path.join(ROOT, "tests", "fault_injection")
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2, "microbatches": 2}}


def config(tmp_path, name, layout, **run):
    return write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 1, "device": "cuda", "watchdog_s": 8.0,
                "first_step_s": 120.0, **run},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": LAYOUTS[layout],
        "optim": {"lr": 3e-3},
        "checkpoint": {"every": 2, "keep": 3},
        "log": {"plot": False, "tensorboard": False},
    })


def faulty(tmp_path, cfg, fault, rank=FAULT_RANK):
    mark, exits = tmp_path / "fault_time", tmp_path / "exits"
    exits.mkdir(exist_ok=True)
    r = train(cfg, 2, extra_env={"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_FAULT": fault,
                                 "FXM_FAULT_RANK": str(rank), "FXM_FAULT_STEP": str(FAULT_STEP),
                                 "FXM_FAULT_MARK": str(mark), "FXM_EXIT_DIR": str(exits)}, timeout=240)
    ended = time.time() - float(mark.read_text())     # from the fault to the end of every process
    return r, ended, {int(f.name.split("-")[1]): int(f.read_text()) for f in exits.iterdir()}


def losses(out):
    return [row["loss"] for row in rows(out)]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def reference(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"faults_gpu_{request.param}")
    r = train(config(tmp, "ref", request.param), 2)
    assert r.returncode == 0, r.stdout
    assert "(nccl, cuda)" in r.stdout, r.stdout
    return request.param, losses(tmp / "ref")


@pytest.mark.parametrize("fault, says", [
    ("raise", rf"rank {FAULT_RANK} failed at step {FAULT_STEP}: RuntimeError: injected fault"),
    ("kill", rf"rank\s*: {FAULT_RANK} \(local_rank: {FAULT_RANK}\)\s*exitcode\s*: -9"),
    ("sleep", rf"rank {FAULT_RANK} stalled in step {FAULT_STEP}"),
], ids=["raise", "kill", "sleep"])
def test_fault_ends_the_job_and_resume_continues(reference, tmp_path, fault, says):
    layout, ref = reference
    cfg = config(tmp_path, "run", layout)
    r, ended, _ = faulty(tmp_path, cfg, fault)
    assert r.returncode != 0, r.stdout
    assert re.search(says, r.stdout), r.stdout
    assert ended < 60, (ended, r.stdout)
    assert len(rows(tmp_path / "run")) == FAULT_STEP, r.stdout
    r2 = train(cfg, 2)
    assert r2.returncode == 0, r2.stdout
    assert "resumed from " + str(tmp_path / "run" / "checkpoints" / "step-00000002") in r2.stdout, r2.stdout
    assert losses(tmp_path / "run") == ref


def test_sigterm_saves_the_agreed_step_and_resume_continues(reference, tmp_path):
    layout, ref = reference
    cfg = config(tmp_path, "run", layout)
    r, _, exits = faulty(tmp_path, cfg, "term_rank")
    assert exits == {0: 0, 1: 0} and r.returncode == 0, r.stdout
    done = FAULT_STEP + 1
    assert f"stopped by SIGTERM after step {done}; checkpoint saved at step {done}" in r.stdout, r.stdout
    r2 = train(cfg, 2)
    assert r2.returncode == 0, r2.stdout
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / f'step-{done:08d}'}" in r2.stdout, r2.stdout
    assert losses(tmp_path / "run") == ref


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_nan_on_one_rank_acts_on_every_rank(tmp_path, policy):
    if policy == "skip":
        r = train(config(tmp_path, "all", "tp2", on_nonfinite="skip"), 2,
                  extra_env={"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_FAULT": "nan", "FXM_FAULT_RANK": "all",
                             "FXM_FAULT_STEP": str(FAULT_STEP)})
        assert r.returncode == 0, r.stdout
    cfg = config(tmp_path, "one", "tp2", on_nonfinite=policy)
    r, ended, _ = faulty(tmp_path, cfg, "nan")
    if policy == "skip":
        assert r.returncode == 0 and "update skipped" in r.stdout, r.stdout
        assert losses(tmp_path / "one") == losses(tmp_path / "all")
    else:
        assert r.returncode == 1, r.stdout
        assert f"failed at step {FAULT_STEP}: TrainingError: step {FAULT_STEP}: " in r.stdout, r.stdout
        assert f"at step {FAULT_STEP + 1}" not in r.stdout and ended < 60, r.stdout
        assert len(rows(tmp_path / "one")) == FAULT_STEP, r.stdout
