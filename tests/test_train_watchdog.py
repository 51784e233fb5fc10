"""fxmegatron.train.watchdog: a job whose rank raises, dies or stalls ends on every rank within
30 s of the fault, with a line naming the rank and the step; a healthy job (slow first step included) is
left alone; check_finite.

The multi-process jobs (tests/workers/watchdog_job.py, 4 gloo ranks, timeout 5 s) all start
together, once for the module, so the file costs about as long as its slowest job. The SIGKILL
job runs as four plain processes, without torchrun: torchrun would end the others itself as
soon as a local worker dies, and the watchdog is for peers on other hosts.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from fxmegatron.errors import ConfigError, PipelineError, TrainingError
from fxmegatron.runtime.distributed import free_port
from fxmegatron.train.watchdog import _secondary, check_finite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "workers", "watchdog_job.py")
LIMIT_S = 30          # every faulty job must be over by then, from its fault (its launch on a
                      # loaded 2-core machine alone has taken 58 s, so the launch is not counted)
BACKSTOP_S = 150      # a hung job is killed here, so a failing test does not hang CI
WATCH = ["--timeout", "5", "--poll", "0.5"]

ONE_RANK = """
import re, sys, time
sys.path.insert(0, ROOT)
from fxmegatron.train.watchdog import Watchdog
with Watchdog(0, 1, timeout_s=1, poll_s=0.2, first_step_timeout_s=5) as wd:
    for k in range(5):
        wd.step(k)
        if k == 2:
            print(f"rank 0 {sys.argv[1]} at step 2 t={time.time():.3f}", flush=True)
            if sys.argv[1] == "sleep":
                time.sleep(1000)
            re.match(r"(a+)+$", "a" * 60 + "b")     # keeps the GIL for ages: no thread runs
"""


class Job:
    """Processes started now; ``result()`` waits for all of them (killing them at the backstop)
    and gives (exit code, combined output, seconds from start to end, seconds from the fault
    to the end or None)."""

    def __init__(self, cmds, envs):
        self.t0 = time.time()
        self.logs, self.codes, self.ends, self.waiters = [], [], [], []
        for cmd, env in zip(cmds, envs):
            log = tempfile.TemporaryFile(mode="w+")
            self.logs.append(log)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            # a thread per process, so each end is timed when it happens, not when looked at
            self.waiters.append(threading.Thread(target=self._wait, args=(proc,), daemon=True))
            self.waiters[-1].start()
        self._result = None

    def _wait(self, proc):
        try:
            code = proc.wait(timeout=BACKSTOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        self.codes.append(code)
        self.ends.append(time.time())

    def result(self):
        if self._result is None:
            for w in self.waiters:
                w.join()
            codes, ends = self.codes, self.ends
            out = ""
            for log in self.logs:
                log.seek(0)
                out += log.read()
                log.close()
            fault = re.search(r"at step \d+ t=([\d.]+)", out)
            # a launcher's code, else the first non-zero rank's (0 only if every rank ended well)
            code = codes[0] if len(codes) == 1 else next((c for c in codes if c != 0), 0)
            end = max(ends)
            self._result = (code, out, end - self.t0, end - float(fault.group(1)) if fault else None)
        return self._result


def _torchrun(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", JOB, *WATCH, *args]
    return Job([cmd], [dict(os.environ, OMP_NUM_THREADS="1")])


def _plain(*args, world=4):
    """One process per rank, as on separate hosts: nothing but the watchdog ends them."""
    port = free_port()
    envs = [dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(world)]
    for env in envs:
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return Job([[sys.executable, JOB, *WATCH, *args]] * world, envs)


def _one_rank(mode):
    return Job([[sys.executable, "-c", ONE_RANK.replace("ROOT", repr(ROOT)), mode]], [dict(os.environ)])


@pytest.fixture(scope="module")
def jobs():
    started = {
        "healthy": _torchrun("--fault", "none", "--slow-first", "6"),     # step 0 longer than timeout_s
        "raise": _torchrun("--fault", "raise", "--fault-rank", "2"),
        "stall": _torchrun("--fault", "stall", "--fault-rank", "3"),
        "kill": _plain("--fault", "kill", "--fault-rank", "1", "--other-hosts"),
        "kill_host": _plain("--fault", "kill", "--fault-rank", "0"),
        "one_rank_sleep": _one_rank("sleep"),
        "one_rank_frozen": _one_rank("frozen"),
    }
    yield started
    for job in started.values():
        job.result()


def _ours(out):
    """Our lines, by the rank that printed them (the first rank each names)."""
    lines = [l for l in out.splitlines() if l.startswith("fxmegatron: ")]
    by_rank = {}
    for l in lines:
        by_rank.setdefault(int(re.match(r"fxmegatron: rank (\d+)", l).group(1)), []).append(l)
    assert all(len(v) == 1 for v in by_rank.values()), lines        # one line per rank
    return lines


def _faulty(jobs, name, *expected):
    code, out, wall, after_fault = jobs[name].result()
    log = out[-6000:]
    assert after_fault is not None, ("the job never printed its fault line", log)
    print(f"\n{name}: over {wall:.1f} s after launch, {after_fault:.1f} s after the fault", end=" ")
    assert code != 0, log
    assert after_fault < LIMIT_S, (after_fault, log)
    lines = _ours(out)
    for e in expected:
        assert any(e in l for l in lines), (e, log)
    return lines


@pytest.mark.slow
def test_healthy_job_with_a_slow_first_step_finishes(jobs):
    code, out, wall, _ = jobs["healthy"].result()
    assert code == 0, out[-6000:]
    assert out.count("finished 6 steps") == 4 and "fxmegatron:" not in out, out[-6000:]


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job(jobs):
    _faulty(jobs, "raise", "fxmegatron: rank 2 failed at step 3: ValueError: injected failure")
    out = jobs["raise"].result()[1]
    assert "Traceback" in out and 'raise ValueError("injected failure' in out, out[-6000:]   # its traceback


@pytest.mark.slow
def test_a_rank_that_stalls_ends_the_job_with_its_stack(jobs):
    lines = _faulty(jobs, "stall", "fxmegatron: rank 3 stalled in step 3 for ")
    stall = next(l for l in lines if "stalled" in l)
    assert "watchdog_job.py" in stall and "in main" in stall, stall
    assert not any(f"rank {r} stalled" in l for l in lines for r in (0, 1, 2)), lines  # peers wait in a collective


@pytest.mark.slow
def test_a_killed_rank_is_noticed_by_its_peers_on_other_hosts(jobs):
    lines = _faulty(jobs, "kill", "rank 1 stopped responding at step 3")
    for r in (0, 2, 3):                         # every survivor says why it stops
        assert any(l.startswith(f"fxmegatron: rank {r} ") for l in lines), (r, lines)


@pytest.mark.slow
def test_a_killed_store_host_is_named(jobs):
    lines = _faulty(jobs, "kill_host", "rank 0 that holds it is gone")
    for r in (1, 2, 3):
        assert any(l.startswith(f"fxmegatron: rank {r} stopping at step 3") for l in lines), (r, lines)


@pytest.mark.slow
def test_one_rank_stalled_without_a_store(jobs):
    _, out, _, after = jobs["one_rank_sleep"].result()
    _faulty(jobs, "one_rank_sleep", "fxmegatron: rank 0 stalled in step 2 for 1 s (allowed 1 s); loop thread at ")
    assert after < 4, out


@pytest.mark.slow
def test_a_rank_frozen_holding_the_gil_is_ended_by_faulthandler(jobs):
    code, out, wall, after = jobs["one_rank_frozen"].result()
    print(f"\none_rank_frozen: over {wall:.1f} s after launch, {after:.1f} s after the fault", end=" ")
    # the monitor thread cannot run: faulthandler's thread (no GIL) dumps the stacks and exits
    assert code == 1 and "Timeout" in out and "most recent call first" in out, out
    assert after < 10, out


def test_errors_from_a_lost_peer_are_secondary():
    assert _secondary(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242"))
    assert _secondary(PipelineError("pipeline rank failed: rank 1: ValueError: x"))
    try:
        try:
            raise torch.distributed.DistNetworkError("gone")
        except Exception as inner:
            raise ValueError("while sending") from inner
    except ValueError as outer:
        assert _secondary(outer)
    assert not _secondary(ValueError("shapes do not match"))


def test_check_finite():
    assert check_finite(4, torch.tensor(2.5), torch.tensor(0.3))
    assert check_finite(4, 2.5, None)
    assert check_finite(4, torch.tensor(1.0, dtype=torch.bfloat16), 0.5)
    with pytest.raises(TrainingError, match=r"^step 7: loss is nan \(non-finite policy 'stop'\)"):
        check_finite(7, torch.tensor(float("nan")), torch.tensor(1.0))
    with pytest.raises(TrainingError, match=r"step 8: grad norm is inf"):
        check_finite(8, torch.tensor(1.0), torch.tensor(float("inf")))
    with pytest.raises(TrainingError, match=r"step 9: loss is nan and grad norm is -inf"):
        check_finite(9, float("nan"), float("-inf"))
    assert check_finite(10, torch.tensor(float("nan")), torch.tensor(1.0), policy="skip") is False
    assert check_finite(10, torch.tensor(1.0), torch.tensor(float("inf")), policy="skip") is False
    with pytest.raises(ConfigError, match="'stop' or 'skip'"):
        check_finite(1, 1.0, 1.0, policy="ignore")


def test_ranks_that_go_silent_together_are_all_named():
    """Two watched peers silent (one rank killed, the launcher ending another a moment later): the
    heartbeats cannot order deaths that close, so the line names both, the longest silent first."""
    import time as _time

    from fxmegatron.train.watchdog import Watchdog

    wd = Watchdog(rank=1, world=4, poll_s=1.0, peer_timeout_s=8.0)
    wd._store = torch.distributed.HashStore()
    for p, beat in ((0, 3), (2, 5), (3, 7)):
        wd._store.add(f"hb/{p}", beat)
    said = []

    def end(msg, *a, **kw):
        said.append((msg, kw.get("dead")))
        raise StopIteration
    wd._end = end
    now = _time.monotonic()
    with pytest.raises(StopIteration):
        wd._poll_store({2: (5, now - 7.0), 3: (7, now - 8.5)})
    msg, dead = said[0]
    assert msg.startswith("rank 3 stopped responding") and "also silent: rank 2 for 7 s" in msg and dead == 2, msg
    # one silent peer, the other beating: only it is named
    wd._store.add("hb/2", 1)
    with pytest.raises(StopIteration):
        wd._poll_store({2: (5, now - 7.0), 3: (7, now - 8.5)})
    assert "also silent" not in said[1][0] and said[1][1] == 1, said[1]


PEER_FAILED = """
import sys
import torch
sys.path.insert(0, ROOT)
from fxmegatron.train.status import pack_failure as _pack
from fxmegatron.train.watchdog import Watchdog
wd = Watchdog(rank=1, world=2, poll_s=0.1, process_table=False)
wd._store = torch.distributed.HashStore()
wd._store.set("failed", _pack(int(sys.argv[1]), "rank 0 failed before its first step: ShardingError: no"))
wd._poll_store({})
"""


@pytest.mark.parametrize("code", [2, 1])
def test_a_peer_s_bad_input_ends_this_rank_silently_with_its_status(code):
    """A rank that reads a peer's published failure before meeting the same bad input itself
    (the trainer's parallelize raises on every rank, in whatever order) stays silent and ends
    with 2: the job says it once. A peer's run failure (1) is repeated with this rank's name."""
    r = subprocess.run([sys.executable, "-c", PEER_FAILED.replace("ROOT", repr(ROOT)), str(code)], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == code, r.stdout
    if code == 2:
        assert r.stdout.strip() == "", r.stdout
    else:
        assert r.stdout.strip() == "fxmegatron: rank 1 stopping before its first step: rank 0 failed before its " \
                                   "first step: ShardingError: no", r.stdout
