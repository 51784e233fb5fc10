"""``fxmegatron train`` on two "nodes" of this machine: two torchrun launches joined by a c10d
rendezvous (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``, one process
each, gloo, pp2: a pipeline stage per node), data and checkpoints in one shared folder. The
job gives the one-launch run's losses bit for bit, each node writes only its own rank's
checkpoint shards, and when one launch is killed or frozen whole (a node gone) the other ends
within 60 s, naming the lost rank, with a non-zero status."""
import os
import signal
import subprocess
import time
import uuid

import pytest

from fxmegatron.runtime.distributed import free_port
from tests.trainer_runs import ROOT, TINY, TORCHRUN, _children, env, kill_job, rows, train, wait_rows, write_config

pytestmark = pytest.mark.slow

HERE = os.path.join(ROOT, "tests", "fault_injection")


def config(tmp_path, name, steps):
    return write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": steps, "seed": 1, "watchdog_s": 8.0, "first_step_s": 120.0,
                "log_every": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.1}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": {"pp": 2, "microbatches": 2},
        "optim": {"lr": 3e-3},
        "checkpoint": {"every": 2, "keep": 3},
        "log": {"plot": False, "tensorboard": False},
    })


def launch_nodes(cfg, tmp_path):
    """Both launches, as each node of a two-node job runs it. On separate hosts only the node
    whose address is the endpoint hosts the rendezvous store; here both addresses match, so
    ``is_host`` says which one does. Returns [(Popen, log path, writes path)] for node 0, 1."""
    port = free_port()
    rdzv_id = uuid.uuid4().hex
    nodes = []
    for k in (0, 1):
        log, writes = tmp_path / f"node{k}.log", tmp_path / f"node{k}.writes"
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(k), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={k == 0}",
               "-m", "fxmegatron.train", cfg]
        e = env({"PYTHONPATH": HERE + os.pathsep + ROOT, "FXM_WRITES": str(writes)})
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        nodes.append((proc, log, writes))
    return nodes


def rank_of(log):
    """The global rank a node's worker got (the rendezvous, not --node-rank, decides)."""
    return 0 if "fxmegatron train: 2 process(es)" in log.read_text() else 1


def test_two_nodes_train_as_one_launch(tmp_path):
    r = train(config(tmp_path, "one", 6), 2)
    assert r.returncode == 0, r.stdout
    cfg = config(tmp_path, "two", 6)
    nodes = launch_nodes(cfg, tmp_path)
    for proc, log, _ in nodes:
        assert proc.wait(timeout=240) == 0, log.read_text()
    assert [row["loss"] for row in rows(tmp_path / "two")] == [row["loss"] for row in rows(tmp_path / "one")]
    ckpts = tmp_path / "two" / "checkpoints"
    for _, log, writes in nodes:
        rank = rank_of(log)     # pp2: rank r holds stage r
        written = sorted(line.split()[1] for line in writes.read_text().splitlines())
        assert written == [str(ckpts / f"step-{s:08d}.tmp" / f"shard-pp{rank}-tp0.safetensors") for s in (2, 4, 6)]
    assert sorted(os.listdir(ckpts / "step-00000006")) == ["index.json", "shard-pp0-tp0.safetensors",
                                                          "shard-pp1-tp0.safetensors"]


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_node_that_disappears_ends_the_other(tmp_path, how):
    """``kill``: the launch without rank 0 SIGKILLed whole; on one machine the kernel resets its
    sockets, so the survivor's gloo calls fail at once. ``freeze``: SIGSTOPped whole, as a node
    cut off by power or network looks from another host: no reset, only silence, which only the
    watchdog's heartbeats see."""
    cfg = config(tmp_path, "run", 10 ** 4)
    nodes = launch_nodes(cfg, tmp_path)
    try:
        wait_rows(tmp_path / "run", 3, nodes[0][0])
        lead = [n for n in nodes if rank_of(n[1]) == 0][0]
        gone = [n for n in nodes if n is not lead][0]
        t0 = time.time()
        if how == "kill":
            kill_job(gone[0])       # torchrun and its worker at once
        else:
            for pid in [gone[0].pid] + _children(gone[0].pid):
                os.kill(pid, signal.SIGSTOP)
        code = lead[0].wait(timeout=120)
        ended = time.time() - t0
    finally:
        for proc, _, _ in nodes:
            if proc.poll() is None:
                kill_job(proc)
    text = lead[1].read_text()
    assert code != 0, text
    assert ended < 60, (ended, text)
    said = text.split("fxmegatron: rank 0 ", 1)
    assert len(said) == 2 and "rank 1 " in said[1].splitlines()[0], text
