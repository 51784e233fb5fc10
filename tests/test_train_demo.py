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
    assert [int(x["step"]) for x in rs] == list(range(STEPS))
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
