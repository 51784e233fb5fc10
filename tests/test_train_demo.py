"""The README's main job, ``fxmegatron train examples/configs/gpt_tiny.toml``, shortened: torchrun, 2
processes (dp 2), gloo; the loss falls, and loss.csv, the TensorBoard events and loss.png are written."""
import glob
import os

import pytest

from tests.trainer_runs import ROOT, rows, train
from fxmegatron.train.metrics import COLUMNS

pytestmark = pytest.mark.slow

STEPS = 30


def test_demo_config_dp2_loss_falls_and_writes_its_files(tmp_path):
    out = tmp_path / "run"
    r = train(os.path.join(ROOT, "examples", "configs", "gpt_tiny.toml"), 2,
              "--set", f'run.out="{out}"', "--set", f"run.steps={STEPS}", "--set", "layout.pp=1",
              "--set", "layout.tp=1", "--set", "layout.dp=2", "--set", "model.gpt.n_layer=2", "--set",
              "model.gpt.n_embd=64", "--set", "data.seq_len=32", "--set", "eval.every=15",
              "--set", "checkpoint.every=0", "--set", "checkpoint.resume=none", "--set", "optim.lr=3e-3")
    assert r.returncode == 0, r.stdout
    rs = rows(out)
    assert list(rs[0]) == COLUMNS
    assert [int(x["step"]) for x in rs] == list(range(1, STEPS + 1))
    losses = [float(x["loss"]) for x in rs]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert all(float(x["tokens_per_s"]) > 0 and float(x["mem_gib"]) > 0 for x in rs)
    vals = [float(x["val_loss"]) for x in rs if x["val_loss"]]
    assert len(vals) == 2 and vals[-1] < vals[0], vals
    assert os.path.getsize(out / "loss.png") > 10_000
    events = glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 1000
    assert os.path.exists(out / "checkpoints" / f"step-{STEPS:08d}" / "index.json")
    assert "validation" in r.stdout and "tok/s" in r.stdout


def test_context_parallel_cp2_matches_one_process(tmp_path):
    """layout.cp = 2 (2 processes, ring attention): every step's loss and the validation loss are
    the one-process run's to 1e-5 (fp32), and the checkpoint is written once (cp rank 0)."""
    import json
    from tests.trainer_runs import TINY, write_config
    steps = 4

    def run(name, nproc, layout):
        cfg = write_config(tmp_path / f"{name}.toml", {
            "run": {"out": str(tmp_path / name), "steps": steps, "seed": 1, "log_every": 1},
            "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32}},
            "data": {"train": TINY, "seq_len": 32, "global_batch": 4},
            "layout": layout,
            "optim": {"lr": 3e-3, "warmup_steps": 1},
            "eval": {"every": 2, "batches": 1},
            "checkpoint": {"resume": "none"},
            "log": {"plot": False, "tensorboard": False},
        })
        r = train(cfg, nproc)
        assert r.returncode == 0, r.stdout
        rs = rows(tmp_path / name)
        assert [int(x["step"]) for x in rs] == list(range(1, steps + 1))
        return r.stdout, [float(x["loss"]) for x in rs], [float(x["val_loss"]) for x in rs if x["val_loss"]]

    _, ref, ref_val = run("one", 1, {})
    log, got, got_val = run("cp2", 2, {"cp": 2})
    assert "cp=2" in log, log
    for a, b in zip(got + got_val, ref + ref_val):
        assert abs(a - b) <= 1e-5 * abs(b), (got, ref, got_val, ref_val)
    ckpt = tmp_path / "cp2" / "checkpoints" / f"step-{steps:08d}"
    with open(ckpt / "index.json") as f:
        index = json.load(f)
    assert index["layout"] == {"dp": 1, "pp": 1, "tp": 1, "cp": 2}
    assert index["files"] == ["shard-pp0-tp0.safetensors"]
