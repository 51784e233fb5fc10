"""``fxmegatron train --dry-run`` prints the plan (parameters and memory per rank, the schedule)
without a process group: the Llama-3-8B-shaped config at (pp 4, tp 2) in under 30 s of CPU time."""
import os
import re
import resource
import subprocess
import sys

import pytest

from tests.trainer_runs import ROOT, env

CLI = os.path.join(os.path.dirname(sys.executable), "fxmegatron")


def dry_run(config):
    """The run's result and the CPU seconds it took (user + system, its own processes): the
    suite runs two files at a time, so wall time would count the other file's work too."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([CLI, "train", config, "--dry-run"], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.slow
def test_llama8b_shape_pp4_tp2_under_30s():
    r, seconds = dry_run("examples/configs/llama3_8b_shape.toml")
    assert r.returncode == 0, r.stdout
    assert seconds < 30, (seconds, r.stdout)
    out = r.stdout
    assert "8,030,261,248 parameters" in out
    assert "dp 1 × pp 4 × tp 2 = 8 ranks" in out
    rows = re.findall(r"^\s+(\d)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+\d: [\d.]+ × (\d)\s+([\d.]+)$", out, re.M)
    assert [(r[0], r[1]) for r in rows] == [("0", "4"), ("1", "3"), ("2", "2"), ("3", "1")], out
    assert all(float(r[2]) > 10 for r in rows)          # GiB: an 8B model over 8 ranks
    assert re.search(r"^  rank 3 \|", out, re.M), out   # the schedule's picture
    assert not os.path.exists(os.path.join(ROOT, "runs", "llama3_8b_shape", "loss.csv"))


def test_gpt_tiny_dry_run():
    r, _ = dry_run("examples/configs/gpt_tiny.toml")
    assert r.returncode == 0, r.stdout
    assert "dp 1 × pp 2 × tp 2 = 4 ranks" in r.stdout and "Memory per rank" in r.stdout


def test_ep_dry_run_counts_each_ranks_experts(tmp_path):
    """At layout.ep = 2 the dry run plans each rank's half of every block's experts (with the
    sharded optimizer, their state over the ranks holding the same experts): its parameters
    per rank and the other ep rank's experts add up to the model."""
    import numpy as np

    from tests.test_train_expert_parallel import save_mixtral
    from tests.trainer_runs import write_config
    save_mixtral(tmp_path / "mixtral")
    (np.arange(2000) % 128).astype(np.uint16).tofile(tmp_path / "train.bin")
    cfg = write_config(tmp_path / "ep2.toml", {
        "run": {"out": str(tmp_path / "out"), "steps": 1},
        "model": {"kind": "hf", "path": str(tmp_path / "mixtral")},
        "data": {"kind": "tokens", "train": str(tmp_path / "train.bin"), "token_dtype": "uint16",
                 "seq_len": 16, "global_batch": 4},
        "layout": {"dp": 2, "ep": 2, "dp_shard": "optimizer"},
    })
    r, _ = dry_run(str(cfg))
    assert r.returncode == 0, r.stdout
    assert "ep 2 (folded onto dp: each rank holds 0.5 of every block's experts)" in r.stdout, r.stdout
    assert "the experts' over 1 (the ranks holding the same experts)" in r.stdout, r.stdout
    m = re.search(r"sum of stages ([\d,]+) \+ the other ep ranks' experts ([\d,]+) = model ([\d,]+) \+ tied "
                  r"copies 0", r.stdout)
    assert m, r.stdout
    held, others, model = (int(x.replace(",", "")) for x in m.groups())
    assert held + others == model and 0 < others < held, r.stdout
