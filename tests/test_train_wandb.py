"""``log.wandb``: rank 0 logs every row of loss.csv to Weights & Biases (offline by default, in
OUT/wandb), at the row's step, with the config; a missing wandb package is a config error before
any process group work."""
import glob
import json
import math
import os
import sys
import types

import pytest

from fxmegatron.errors import ConfigError
from fxmegatron.train.metrics import Metrics
from fxmegatron.train.wandb_sink import require
from tests.test_train_log import row
from tests.trainer_runs import TINY, rows, train, write_config


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    mod = types.SimpleNamespace(Settings=lambda **kw: kw)

    def init(**kw):
        calls.append(("init", kw))
        return FakeRun(calls)
    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_rows_go_to_the_run_at_their_steps(tmp_path, fake_wandb):
    from fxmegatron.train.wandb_sink import WandbSink
    out = str(tmp_path / "myrun")
    sink = WandbSink(out, "proj", "offline", {"run": {"steps": 2}}, 0, "c.toml")
    m = Metrics(out, 0, tensorboard=False, wandb=sink)
    m.log(row(1, 0.75))
    m.log(row(2, 0.5))
    m.close()
    (_, init), logs, finish = fake_wandb[0], fake_wandb[1:3], fake_wandb[3]
    assert init["project"] == "proj" and init["mode"] == "offline" and init["dir"] == out
    assert init["config"] == {"run": {"steps": 2}} and init["group"] == init["name"] == "myrun"
    assert [s for _, s, _ in logs] == [1, 2]
    first, second = logs[0][2], logs[1][2]
    assert first["train/loss"] == 0.75 and second["train/loss"] == 0.5 and first["train/lr"] == 1e-3
    assert "eval/val_loss" not in first and second["eval/val_loss"] == 4.0     # None: no evaluation that step
    assert "perf/mfu" not in first and first["perf/tokens_per_s"] == 1.0 / 3   # NaN: no MFU on the CPU
    assert finish == ("finish", 0)
    # a resumed job: a new run of the same group, named for its step
    WandbSink(out, "proj", "offline", {}, 3, "c.toml")
    assert fake_wandb[-1][1]["name"] == "myrun (resumed at step 3)" and fake_wandb[-1][1]["group"] == "myrun"


def test_without_the_package_the_config_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)      # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"^c.toml: log.wandb = true needs the wandb package .*pip install "
                                          r"'fxmegatron\[wandb\]'"):
        require("c.toml")


@pytest.mark.slow
def test_a_run_writes_its_losses_offline(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(out), "steps": 2},
        "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 2},
        "eval": {"batches": 1},
        "log": {"plot": False, "tensorboard": False, "wandb": True},
    })
    r = train(cfg, 1, extra_env={"WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stdout
    files = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, os.listdir(out)
    with open(files[0], "rb") as f:
        data = f.read()
    # the run's records hold each logged value as JSON text: the last row's loss and validation loss
    last = rows(out)[-1]
    for key, value in (("loss", last["loss"]), ("val_loss", last["val_loss"])):
        assert math.isfinite(float(value))
        assert key.encode() in data and json.dumps(float(value)).encode() in data, (key, value)
