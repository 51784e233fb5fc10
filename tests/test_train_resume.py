"""``fxmegatron train`` killed with SIGKILL at a random step and restarted with ``resume = "auto"``
gives, bit for bit, the losses of a run that was never interrupted (fp32, gloo, CPU), also when
resumed at another pipeline cut (tp 2 -> pp 2 x tp 2): the gradient norm sums its squares in the
model's parameter order whatever the cut. Another tp or dp size reorders the matmuls' and the
gradients' own sums: equal to rounding only (docs/TRAINER.md)."""
import random

import pytest

from tests.trainer_runs import TINY, kill_job, rows, start, train, wait_rows, write_config

pytestmark = pytest.mark.slow

STEPS = 10


def config(tmp_path, name, layout):
    return write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 3, "log_every": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": layout,
        "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0},
        "eval": {"every": 4, "batches": 1},
        "checkpoint": {"every": 2, "keep": 2},
        "log": {"plot": False},
    })


def kill_and_resume(cfg, out, nproc, resume_cfg=None, resume_nproc=None, seed=0):
    """Start, SIGKILL the whole job once loss.csv has a random number of rows, then resume."""
    k = random.Random(seed).randint(3, STEPS - 2)
    proc = start(cfg, nproc)
    wait_rows(out, k, proc)
    kill_job(proc)      # every process of the job at once, as a crashed node
    killed_at = len(rows(out))
    assert killed_at < STEPS, "the run finished before it was killed"
    r = train(resume_cfg or cfg, resume_nproc or nproc)
    assert r.returncode == 0, r.stdout
    assert "resumed from" in r.stdout, r.stdout
    return killed_at, r.stdout


def losses(out):
    rs = rows(out)
    assert [int(r["step"]) for r in rs] == list(range(1, STEPS + 1)), [r["step"] for r in rs]
    return [r["loss"] for r in rs], [r["val_loss"] for r in rs]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    cfg = config(tmp, "ref", {"tp": 2})
    r = train(cfg, 2)
    assert r.returncode == 0, r.stdout
    return tmp, losses(tmp / "ref")


def test_sigkill_and_resume_is_bitwise(reference, tmp_path):
    _, (ref_loss, ref_val) = reference
    cfg = config(tmp_path, "run", {"tp": 2})
    killed_at, log = kill_and_resume(cfg, tmp_path / "run", 2, seed=1)
    loss, val = losses(tmp_path / "run")
    assert loss == ref_loss, f"killed after {killed_at} rows; {log}"     # the exact decimal strings
    assert val == ref_val


def test_resume_at_another_layout(reference, tmp_path):
    _, (ref_loss, _) = reference
    cfg = config(tmp_path, "run", {"tp": 2})
    other = config(tmp_path, "other", {"pp": 2, "tp": 2})
    with open(other) as f:      # the same output folder and checkpoints, another layout
        text = f.read().replace(str(tmp_path / "other"), str(tmp_path / "run"))
    with open(other, "w") as f:
        f.write(text)
    killed_at, log = kill_and_resume(cfg, tmp_path / "run", 2, resume_cfg=other, resume_nproc=4, seed=2)
    assert "pp=2" in log
    loss, _ = losses(tmp_path / "run")
    assert loss == ref_loss, f"killed after {killed_at} rows; {log}"     # the exact decimal strings


def test_another_pipeline_cut_trains_bit_for_bit_alike(reference, tmp_path):
    """The uninterrupted pp 2 x tp 2 run gives the tp 2 run's losses exactly, at every step: so a
    resume at that cut is bitwise whatever step the kill lands on."""
    _, (ref_loss, ref_val) = reference
    r = train(config(tmp_path, "pp", {"pp": 2, "tp": 2}), 4)
    assert r.returncode == 0, r.stdout
    assert losses(tmp_path / "pp") == (ref_loss, ref_val)
