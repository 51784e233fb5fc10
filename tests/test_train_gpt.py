"""examples/train_gpt.py end to end: torchrun, 2 processes, tp=2 on gloo, a short small run."""
import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
STEPS = 30


def test_train_gpt_tp2_loss_falls_and_writes_csv_and_png(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           "--tp", "2", "--steps", str(STEPS), "--out", str(out),
           "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "8",
           "--lr", "3e-3", "--eval-every", "15", "--eval-batches", "1", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log

    with open(out / "loss.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == STEPS, log
    assert list(rows[0]) == ["step", "loss", "tokens_per_s", "elapsed_s", "val_loss"]
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    losses = [float(r["loss"]) for r in rows]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    elapsed = [float(r["elapsed_s"]) for r in rows]
    assert elapsed == sorted(elapsed)
    vals = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert len(vals) == 2 and vals[-1] < losses[0], rows     # after steps 15 and 30

    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "layout" in proc.stdout and str(out / "loss.csv") in proc.stdout, log
