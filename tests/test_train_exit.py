"""How ``fxmegatron train`` ends when something is wrong: bad input ends every process with status
2 and one line (per host before the process group, from the rank that met it after), a config
asking for more GPUs than the host has is bad input, ``--nproc-per-node`` (torchrun's launch in
the CLI's process) ends with the workers' status and without torchrun's report, and a SIGKILLed
rank ends the job within seconds (the process table, not a heartbeat timeout)."""
import os
import subprocess
import sys
import time

import torch

from tests.test_train_bad_config import base, one_line, run_main
from tests.trainer_runs import ROOT, TINY, env, write_config

FAULTS = os.path.join(ROOT, "tests", "fault_injection")


def test_bad_config_ends_every_rank_with_2_and_one_line_per_host(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, optim={"learning_rate": 1e-3}))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, err = run_main(monkeypatch, capsys, cfg, world=2)        # rank 0, local rank 0
    assert code == 2
    one_line(err, "unknown key optim.learning_rate")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    capsys.readouterr()
    from fxmegatron.train.main import main
    assert main([str(cfg)]) == 2         # not 0: torchrun on another host would call its job a success
    assert capsys.readouterr().err == ""
    # under torchrun it waits for torchrun to end it (local rank 0 fails alike); if nothing does, it says why
    import fxmegatron.train.main as train_main
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(train_main, "LOCAL_RANK_0_GRACE_S", 0.0)
    assert main([str(cfg)]) == 2
    one_line(capsys.readouterr().err, "unknown key optim.learning_rate")


def test_more_gpus_than_the_host_has(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, run={"device": "cuda"}))
    procs = torch.cuda.device_count() + 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(procs))
    code, err = run_main(monkeypatch, capsys, cfg, world=procs)
    assert code == 2
    one_line(err, f"run.device = 'cuda' asks for a GPU per process: {procs} process(es) on this host, but torch "
                  f"sees {procs - 1} GPU(s) here")
    # "auto" on a host with GPUs, but fewer than processes, would have trained on the CPU unasked
    cfg = write_config(tmp_path / "c.toml", base(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, err = run_main(monkeypatch, capsys, cfg, world=2)
    assert code == 2
    one_line(err, "run.device = 'auto' asks for a GPU per process: 2 process(es) on this host, but torch sees 1 GPU(s) "
                  "here: start at most 1 per host (torchrun --nproc-per-node) or set run.device = \"cpu\"")


def test_unknown_cli_command_is_a_usage_error(capsys):
    from fxmegatron.cli import main
    assert main(["trian", "c.toml"]) == 2
    assert capsys.readouterr().err == "fxmegatron: unknown command 'trian' (train, export, eval, generate, verify, " \
        "compile, launch, schedule)\n"


def _launch(cfg, *args, extra_env=None):
    cmd = [sys.executable, "-m", "fxmegatron.cli", "train", str(cfg), "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=240)


def _config(tmp_path, layout, **run):
    return write_config(tmp_path / "c.toml", {
        "run": {"out": str(tmp_path / "out"), "steps": 4, **run},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 16}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 4},
        "layout": layout, "log": {"plot": False, "tensorboard": False}})


def test_bad_layout_under_the_launcher_is_one_line_and_status_2(tmp_path):
    cfg = _config(tmp_path, {"tp": 2})
    r = _launch(cfg, "--set", "model.gpt.n_head=3", "--set", "model.gpt.n_embd=24")   # tp=2 cannot split 3 heads
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stdout
    assert len(lines) == 1, r.stdout          # no traceback, no torchrun report, not once per rank
    assert lines[0].startswith("fxmegatron: rank ") and " failed before its first step: ShardingError: tp=2 does " \
        "not divide dim 2 (size 3)" in lines[0], r.stdout


def test_a_killed_rank_ends_the_job_within_seconds(tmp_path):
    # run.watchdog_s at its default: a heartbeat would take its 30 s to go stale
    cfg = _config(tmp_path, {"pp": 2, "microbatches": 2})
    mark = tmp_path / "fault_time"
    r = _launch(cfg, extra_env={"PYTHONPATH": FAULTS + os.pathsep + ROOT, "FXM_FAULT": "kill", "FXM_FAULT_RANK": "1",
                                "FXM_FAULT_STEP": "1", "FXM_FAULT_MARK": str(mark)})
    ended = time.time() - float(mark.read_text())
    print(f"\nkilled rank: the job ended {ended:.1f} s after the kill")
    assert r.returncode == 1, r.stdout
    assert "fxmegatron: rank 0 stopping at step 1: rank 1 died at step 1: its process " in r.stdout, r.stdout
    assert "fxmegatron train: rank 1 (pid " in r.stdout and ") was ended by SIGKILL" in r.stdout, r.stdout
    assert "Traceback" not in r.stdout, r.stdout
    assert ended < 10, (ended, r.stdout)
