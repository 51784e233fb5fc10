"""What rank 0 writes per step: loss.csv counts steps from 1 (as the console and the checkpoints do),
and ``log.jsonl = true`` writes the same rows as JSON lines; a resume keeps both consistent."""
import json
import math
import os
import shutil

import pytest

from fxmegatron.train.metrics import COLUMNS, Metrics
from tests.trainer_runs import TINY, rows, train, write_config


def jsonl(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def agree(out):
    """loss.csv and log.jsonl, row by row and value by value (floats exact: repr of one is the other's text)."""
    csv_rows, json_rows = rows(out), jsonl(out)
    assert len(csv_rows) == len(json_rows), (len(csv_rows), len(json_rows))
    for c, j in zip(csv_rows, json_rows):
        assert list(j) == COLUMNS
        for k in COLUMNS:
            v = j[k]
            text = "" if v is None else repr(float(v)) if isinstance(v, float) else str(v)
            assert text == c[k], (k, c, j)
    return [int(r["step"]) for r in csv_rows], [r["loss"] for r in csv_rows]


def row(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1.0 / 3,
            "tflops_per_device": 0.0, "mfu": float("nan"), "mem_gib": 0.25, "elapsed_s": 1.5,
            "val_loss": 2.0 + step if step % 2 == 0 else None}


def test_resume_keeps_the_rows_its_checkpoint_holds_in_both_files(tmp_path):
    m = Metrics(str(tmp_path), 0, tensorboard=False, jsonl=True)
    for s in range(1, 6):
        m.log(row(s, 1.0 / s))
    # resumed from step-00000003: rows 1..3 are kept, 4 and 5 go (the steps that run again)
    m = Metrics(str(tmp_path), 3, tensorboard=False, jsonl=True)
    assert [r["step"] for r in m.rows] == [1, 2, 3]
    m.log(row(4, 0.3))
    steps, losses = agree(str(tmp_path))
    assert steps == [1, 2, 3, 4] and losses[-1] == repr(0.3)
    assert math.isnan(jsonl(tmp_path)[0]["mfu"]) and jsonl(tmp_path)[0]["val_loss"] is None


def test_a_loss_csv_counted_from_0_is_renumbered_on_resume(tmp_path):
    """A run started before steps counted from 1, resumed now from step-00000002: its rows 0 and 1
    are steps 1 and 2; row 2 (the third step) runs again."""
    with open(tmp_path / "loss.csv", "w") as f:
        f.write(",".join(COLUMNS) + "\n" + "".join(f"{s},{s + 1.5},0.1,1.0,1.0,0.0,nan,1.0,1.0,\n" for s in range(3)))
    m = Metrics(str(tmp_path), 2, tensorboard=False, jsonl=True)
    assert [(r["step"], r["loss"]) for r in m.rows] == [(1, 1.5), (2, 2.5)]
    assert [int(r["step"]) for r in rows(tmp_path)] == [1, 2]


@pytest.mark.slow
def test_a_run_and_its_resume_write_loss_csv_and_log_jsonl_alike(tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(out), "steps": 4},
        "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 4},
        "eval": {"every": 2, "batches": 1},
        "checkpoint": {"every": 2, "keep": 3},
        "log": {"plot": False, "tensorboard": False, "jsonl": True},
    })
    r = train(cfg, 1)
    assert r.returncode == 0, r.stdout
    steps, first = agree(out)
    assert steps == [1, 2, 3, 4]
    assert "step 4/4" in r.stdout and "step 4: checkpoint" in r.stdout
    # as after a kill between the saves of steps 2 and 4: the resume rewrites rows 3 and 4
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    r = train(cfg, 1)
    assert r.returncode == 0 and "resumed from" in r.stdout and "at step 2" in r.stdout, r.stdout
    steps, again = agree(out)
    assert steps == [1, 2, 3, 4] and again == first
