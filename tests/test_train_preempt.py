"""Preemption and save atomicity of ``fxmegatron train`` (2 processes, gloo, tp2): SIGTERM to
torchrun, or to one rank alone, stops every rank at the same step boundary with a checkpoint
of that step and exit status 0 on every rank, and ``resume = "auto"`` continues to the losses
of a run never stopped, bit for bit; a job SIGKILLed half-way through writing a checkpoint
leaves the previous one to resume from. Faults come from tests/fault_injection/sitecustomize.py."""
import os

import pytest

from fxmegatron.train.checkpoints import complete
from tests.trainer_runs import ROOT, TINY, rows, train, write_config

pytestmark = pytest.mark.slow

STEPS = 6
HERE = os.path.join(ROOT, "tests", "fault_injection")


def config(tmp_path, name):
    return write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 1, "watchdog_s": 8.0,
                "first_step_s": 120.0},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": {"tp": 2},
        "optim": {"lr": 3e-3},
        "checkpoint": {"every": 2, "keep": 3},
        "log": {"plot": False, "tensorboard": False},
    })


def faulty(tmp_path, cfg, fault, rank, step):
    """Run ``cfg`` with ``fault`` injected; returns (the run, {rank: the status its main returned})."""
    exits = tmp_path / "exits"
    exits.mkdir()
    r = train(cfg, 2, extra_env={"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_FAULT": fault,
                                 "FXM_FAULT_RANK": str(rank), "FXM_FAULT_STEP": str(step),
                                 "FXM_EXIT_DIR": str(exits)}, timeout=240)
    return r, {int(f.name.split("-")[1]): int(f.read_text()) for f in exits.iterdir()}


def losses(out):
    return [row["loss"] for row in rows(out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt")
    r = train(config(tmp, "ref"), 2)
    assert r.returncode == 0, r.stdout
    return losses(tmp / "ref")


@pytest.mark.parametrize("fault", ["term", "term_rank"])
def test_sigterm_stops_every_rank_at_one_step_and_resume_is_bitwise(reference, tmp_path, fault):
    """``term``: torchrun gets SIGTERM during step 2 and forwards it to both ranks (rank 1 sleeps
    1 s meanwhile, so both have it before step 2 ends); ``term_rank``: rank 1 alone gets it, and
    rank 0 learns of it through the all-reduce at the step boundary. Either way both stop after
    step 2 and save step 3, which no cadence would have saved."""
    cfg = config(tmp_path, "run")
    r, exits = faulty(tmp_path, cfg, fault, 1, 2)
    assert exits == {0: 0, 1: 0}, r.stdout
    # torchrun itself re-raises the SIGTERM it was sent once its workers have left (status 1)
    assert r.returncode == (1 if fault == "term" else 0), r.stdout
    assert "stopped by SIGTERM after step 3; checkpoint saved at step 3" in r.stdout, r.stdout
    ckpts = tmp_path / "run" / "checkpoints"
    assert complete(str(ckpts))[-1] == str(ckpts / "step-00000003"), r.stdout
    assert len(rows(tmp_path / "run")) == 3
    if fault == "term_rank":
        return      # the same stop as "term"'s, whose resume is tested
    r2 = train(cfg, 2)
    assert r2.returncode == 0, r2.stdout
    assert f"resumed from {ckpts / 'step-00000003'} at step 3" in r2.stdout, r2.stdout
    assert losses(tmp_path / "run") == reference


def test_the_launcher_ends_a_preempted_job_with_status_0(tmp_path):
    """``fxmegatron train CONFIG --nproc-per-node 2`` gets SIGTERM during step 2 (the ``term``
    fault signals the workers' parent, here the launcher): the workers stop, save and return
    0, and so does the launcher (torchrun ends with 1 whatever its workers did)."""
    import subprocess
    import sys

    from tests.trainer_runs import env
    cfg = config(tmp_path, "run")
    r = subprocess.run([sys.executable, "-m", "fxmegatron.train", cfg, "--nproc-per-node", "2"], cwd=ROOT,
                       env=env({"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_FAULT": "term", "FXM_FAULT_RANK": "1",
                                "FXM_FAULT_STEP": "2"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=240)
    assert "stopped by SIGTERM after step 3; checkpoint saved at step 3" in r.stdout, r.stdout
    assert r.returncode == 0, r.stdout


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(reference, tmp_path):
    """Rank 1 is SIGKILLed once half of its shard of step 4 is on disk: the job ends, step 4
    never becomes a checkpoint, and the resume starts from step 2."""
    cfg = config(tmp_path, "run")
    r, exits = faulty(tmp_path, cfg, "kill_in_save", 1, 4)
    assert r.returncode != 0 and 1 not in exits, r.stdout
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "step-00000004.tmp" / "shard-pp0-tp1.safetensors").exists(), r.stdout
    assert complete(str(ckpts)) == [str(ckpts / "step-00000002")], r.stdout
    r2 = train(cfg, 2)
    assert r2.returncode == 0, r2.stdout
    assert f"resumed from {ckpts / 'step-00000002'} at step 2" in r2.stdout, r2.stdout
    assert losses(tmp_path / "run") == reference
