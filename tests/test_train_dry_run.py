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
