"""A training loop that never hangs: a failing, dead or stalled rank ends every rank, with one
line on stderr that names the rank, the step and the cause.

Without this, a collective whose peer raised, died or froze waits for the backend's timeout
(NCCL: minutes to hours). ``Watchdog`` wraps the loop on every rank::

    with Watchdog(rank, world, timeout_s=300) as wd:      # a collective when no store is given
        for k in range(steps):
            wd.step(k)                                     # the heartbeat of the loop
            ...                                            # an exception escaping ends the job

Each rank runs a daemon thread that, every ``poll_s``, bumps its heartbeat in a side-channel
store (torchrun's agent store, or one hosted by rank 0) and ends the process when

* some rank published a failure (a raise, a stall, a dead peer): it prints that failure;
* a peer on this machine has ended (``fxmegatron.train.liveness``: the process table, as
  torchrun's agent knows it; seen at the next poll) without leaving the loop cleanly;
* a watched peer's heartbeat has not moved for ``peer_timeout_s`` (SIGKILLed, crashed, or its
  Python frozen holding the GIL); each rank watches its next two live ranks, so every death is
  seen by a survivor without every rank reading every heartbeat;
* the store is unreachable (its host, rank 0 or the node of torchrun's agent, is gone);
* its own loop made no ``wd.step`` for the step's allowance (``first_step_timeout_s`` for the
  first step, which compiles; ``timeout_s`` after): it publishes the loop thread's stack. A
  loop thread blocked inside a collective, or on a GPU with queued work (NCCL collectives are
  kernels, so a rank blocked in ``.item()`` may wait for a peer), is waiting on someone else:
  it waits ``peer_timeout_s`` more, so that the peer's own failure or death is named first.

A C call that keeps the GIL (a long regex, some extensions; torch's ``.item()`` and CUDA syncs
release it) starves that thread, so ``faulthandler.dump_traceback_later`` is armed too, re-armed
at each step: it needs no GIL and kills a frozen rank,
printing every thread's stack (several lines, faulthandler's format) after the allowance plus
a margin. Processes end with ``os._exit`` after flushing, so no atexit hook or NCCL teardown
can hang them: status 2 for a rank's own bad-input error (``status.exit_status``), else 1.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from fxmegatron.errors import ConfigError, PipelineError
from fxmegatron.train.liveness import LocalPeers
from fxmegatron.train.status import FAILED, check_finite, exit_status, pack_failure as _pack, \
    unpack_failure as _unpack  # noqa: F401  (check_finite: re-exported)

_DONE = 1 << 50        # a heartbeat counter at or above this: the rank left the loop cleanly
_WATCHED = 2           # live successors each rank watches (a dead run of ranks is still seen
                       # by the survivor just before it)
_EXIT_LOCK = threading.Lock()    # the first thread to decide to end the process prints alone
_instances = 0         # Watchdogs entered in this process: keys of a reused store stay apart
_SECONDARY = ("connection closed", "connection reset", "closed by peer", "broken pipe", "timed out")


def _log(line: str) -> None:
    for write in (sys.stdout.flush, lambda: sys.stderr.write(line + "\n"), sys.stderr.flush):
        try:
            write()
        except Exception:   # a closed stream must not stop the exit
            pass


def _where(step) -> str:
    # the trainer runs parallelize as step -1
    return f"at step {step}" if step is not None and step >= 0 else "before its first step"


def _one_line(text: str, limit: int = 1500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _stack_line(frame, depth: int = 6) -> str:
    """Innermost frames first, on one line."""
    if frame is None:
        return "<no Python frame>"
    frames = traceback.extract_stack(frame)[::-1][:depth]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames)


def _in_collective(frame) -> bool:
    """Whether the innermost frames, below the first frame outside torch, are torch.distributed
    (a collective or a wait on a work) or fxmegatron's pipeline waits."""
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in name or name.endswith("fxmegatron/schedules/runtime.py"):
            return True
        if "/torch/" not in name and not name.endswith("/threading.py"):
            return False
        frame = frame.f_back
    return False


def _gpu_busy(device: Optional[int]) -> bool:
    """Whether the default stream of the loop thread's GPU still has work queued."""
    if device is None:
        return False
    try:
        return not torch.cuda.default_stream(device).query()
    except Exception:        # a broken CUDA context: say nothing rather than fail the monitor
        return False


def _secondary(exc: BaseException) -> bool:
    """Whether an error may be this rank's view of a peer that went away (gloo raises
    'Connection closed by peer' in every survivor of a SIGKILL); then the peer is the cause."""
    while exc is not None:
        if isinstance(exc, (dist.DistError, PipelineError)):
            return True
        if any(s in str(exc).lower() for s in _SECONDARY):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Watchdog:
    """Ends every rank, each with one line naming the failing rank and step, when a rank raises
    in the loop, dies, or stalls; see the module docstring. ``rank``/``world`` default to the
    default process group's. ``store``: a store every rank already shares (keys go under a
    prefix); None: torchrun's agent store when torchrun runs one, else rank 0 hosts a TCPStore
    whose address ``__enter__`` broadcasts over the default group (a collective)."""

    def __init__(self, rank: Optional[int] = None, world: Optional[int] = None, timeout_s: float = 300.0,
                 store=None, poll_s: float = 1.0, *, first_step_timeout_s: Optional[float] = None,
                 peer_timeout_s: Optional[float] = None, host: Optional[str] = None, process_table: bool = True):
        ready = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if ready else 0)
        self.world = world if world is not None else (dist.get_world_size() if ready else 1)
        self.timeout_s = float(timeout_s)
        self.first_step_timeout_s = float(first_step_timeout_s if first_step_timeout_s is not None
                                          else max(3 * timeout_s, 600.0))
        self.peer_timeout_s = float(peer_timeout_s if peer_timeout_s is not None else min(timeout_s, 30.0))
        self.poll_s = float(poll_s)
        if min(self.timeout_s, self.first_step_timeout_s, self.peer_timeout_s, self.poll_s) <= 0:
            raise ConfigError("watchdog timeouts and poll_s must be positive")
        self._given, self._host = store, host
        self._store = None
        self._store_host: Optional[int] = None   # the rank whose process holds the store
        self._holder = "the process that hosts it"  # named when the store is lost
        self._server = None
        self._lock = threading.Lock()            # one store op at a time across our two threads
        # (step, since, allowance), replaced as a whole: the monitor never sees a torn update
        self._state = (None, time.monotonic(), self.first_step_timeout_s)
        self._quiet = False      # the loop thread is in fail() or __exit__: no self-stall check
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._loop_ident: Optional[int] = None
        self._device: Optional[int] = None       # the loop thread's GPU, once CUDA is up
        # process_table=False: peers judged by their heartbeats alone, as if each ran on a host of its own
        self._local = LocalPeers(self.rank, self.world) if process_table else None

    # ---- what the trainer calls ------------------------------------------------------------
    def __enter__(self) -> "Watchdog":
        global _instances
        _instances += 1
        self._loop_ident = threading.get_ident()
        if self.world > 1:
            self._store = self._connect(_instances)
            if self._local:
                self._local.publish(self._op, self._store)
            self._op(self._store.add, f"hb/{self.rank}", 1)
        self._state = (None, time.monotonic(), self.first_step_timeout_s)
        self._arm(self.first_step_timeout_s)
        self._thread = threading.Thread(target=self._monitor, name="fxmegatron-watchdog", daemon=True)
        self._thread.start()
        return self

    def step(self, k: int, timeout_s: Optional[float] = None) -> None:
        """Step ``k`` starts: it must reach the next ``step`` (or the end of the ``with``) within
        ``timeout_s`` (default: ``first_step_timeout_s`` for the first call, else ``timeout_s``)."""
        first = self._state[0] is None
        allow = float(timeout_s) if timeout_s is not None else (
            self.first_step_timeout_s if first else self.timeout_s)
        self._state = (k, time.monotonic(), allow)
        self._arm(allow)
        if self._device is None and torch.cuda.is_initialized():
            # the current device is per thread: the monitor must be told which GPU to look at
            self._device = torch.cuda.current_device()
        if self._store is not None:
            # here rather than in the monitor, whose next poll a rank killed right now would
            # not reach; one small store write per step
            try:
                self._op(self._store.set, f"step/{self.rank}", str(k))
            except Exception:    # the monitor reports a lost store
                pass

    def fail(self, k: Optional[int], exc: BaseException) -> NoReturn:
        """This rank failed at step ``k`` (None: the current step) with ``exc``: publish it,
        print it (the traceback, then the one line) and end the process with status 1. An error
        that may come from a dead peer first waits up to ``peer_timeout_s`` for that peer to be
        named. Never returns."""
        self._quiet = True
        k = self._state[0] if k is None else k
        msg = f"rank {self.rank} failed {_where(k)}: {type(exc).__name__}: {_one_line(exc)}"
        if self._store is not None and _secondary(exc) and self._thread is not None:
            if threading.current_thread() is threading.main_thread():
                # torchrun's SIGTERM after a worker died must not end this rank before it is named
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            wait = self.peer_timeout_s + 3 * self.poll_s
            self._arm(wait)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:     # the monitor ends the process if it finds one
                time.sleep(self.poll_s / 4)
        self._end(msg, exc=exc, code=exit_status(exc))

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self.fail(None, exc)
        self._quiet = True
        faulthandler.cancel_dump_traceback_later()
        try:
            self._finish()
        except Exception as err:      # the store went away under the closing barrier
            self._end(None, lost=err)
        self._stop.set()
        self._thread.join()
        return False

    # ---- the side channel --------------------------------------------------------------------
    def _connect(self, instance: int):
        timeout = datetime.timedelta(seconds=max(10.0, 5 * self.poll_s))
        env = os.environ
        if self._given is not None:
            return dist.PrefixStore(f"fxmegatron/watchdog/{instance}", self._given)
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_PORT"):
            self._holder = f"torchrun's agent on {env['MASTER_ADDR']}"
            # torchrun's agent hosts this store and outlives its workers: a dead rank 0 is then
            # named like any other. Keys are per run and restart, so a restarted group does not
            # read the failure that ended the previous one.
            client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timeout=timeout)
            prefix = f"fxmegatron/watchdog/{env.get('TORCHELASTIC_RUN_ID', '')}/" \
                     f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{instance}"
            return dist.PrefixStore(prefix, client)
        self._store_host, self._holder = 0, "rank 0"
        addr = [None]
        if self.rank == 0:
            host = self._host or env.get("MASTER_ADDR") or socket.gethostname()
            self._server = dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
            addr = [(host, self._server.port)]
        dist.broadcast_object_list(addr, src=0)
        if self.rank == 0:
            return self._server
        return dist.TCPStore(addr[0][0], addr[0][1], None, False, timeout=timeout)

    def _op(self, fn, *args):
        with self._lock:
            return fn(*args)

    def _finish(self) -> None:
        """A barrier in the store: no rank leaves before every rank ended its loop (the monitor
        still ends the job if one fails meanwhile), and the store's host leaves last."""
        if self._store is None:
            return
        self._op(self._store.add, f"hb/{self.rank}", _DONE)
        self._op(self._store.add, "done", 1)
        while self._op(self._store.add, "done", 0) < self.world:
            time.sleep(self.poll_s / 2)
        self._stop.set()
        if self.rank != self._store_host:
            self._op(self._store.add, "left", 1)
        else:
            self._linger("left", self.world - 1)

    def _linger(self, key: str, count: int) -> None:
        """The rank holding the store keeps it up until the others have read what they need."""
        if self._store_host != self.rank:
            return
        deadline = time.monotonic() + 3 * self.poll_s + 2.0
        while time.monotonic() < deadline:
            try:
                if self._op(self._store.add, key, 0) >= count:
                    return
            except Exception:
                return
            time.sleep(self.poll_s / 4)

    def _arm(self, allow: float) -> None:
        # past every path of the monitor (a stall, the grace of a loop waiting on a peer), so it
        # only fires when the monitor could not run
        faulthandler.dump_traceback_later(allow + self.peer_timeout_s + 5 * self.poll_s + min(allow, 10.0),
                                          exit=True)

    def _end(self, msg: Optional[str], exc: Optional[BaseException] = None, lost=None,
             mine: bool = True, dead: int = 0, code: int = FAILED) -> NoReturn:
        """Publish ``msg``, a failure of this rank (``mine``) or one it saw, unless another came
        first; print the first one, led by this rank's own name; end the process.
        ``dead``: how many ranks are known dead (they will not acknowledge it). ``code``: the
        exit status; 2 (bad input) prints no traceback, and only on the rank that published it."""
        _EXIT_LOCK.acquire()          # never released: the other thread waits for os._exit
        faulthandler.cancel_dump_traceback_later()
        where = _where(self._state[0])
        if lost is not None:
            line = (f"rank {self.rank} stopping {where}: the watchdog store is unreachable, "
                    f"{self._holder} that holds it is gone: {type(lost).__name__}: {_one_line(lost, 300)}")
        else:
            winner_code, winner = code, msg
            if self._store is not None:
                try:
                    winner_code, winner = _unpack(self._op(self._store.compare_set, "failed", "", _pack(code, msg)))
                    self._op(self._store.add, "acks", 1)
                except Exception:
                    pass
            mine = mine and winner == msg
            if mine and exc is not None and code == FAILED:
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            line = winner if mine else f"rank {self.rank} stopping {where}: {winner}"
            self._linger("acks", self.world - dead)
            if not mine and code != FAILED and winner_code != FAILED:
                line = None     # every rank met the same bad input (or saw a peer's first): the winner says it
        if line:
            _log(f"fxmegatron: {line}")
        os._exit(code)

    # ---- the monitor thread ------------------------------------------------------------------
    def _monitor(self) -> None:
        seen: dict = {}           # peer -> (heartbeat, monotonic time it last moved)
        failing_since = None
        warned = False
        while not self._stop.wait(self.poll_s):
            try:
                if self._store is not None:
                    self._poll_store(seen)
                failing_since = None
            except Exception as exc:
                if self._stop.is_set():
                    return
                now = time.monotonic()
                failing_since = failing_since or now
                # a closed connection does not come back; a slow store gets two more polls
                if isinstance(exc, dist.DistNetworkError) or now - failing_since > 2 * self.poll_s:
                    self._end(None, lost=exc)
            try:
                self._check_self()
            except Exception as exc:   # a bug here must not silently disarm the watchdog
                if not warned:
                    _log(f"fxmegatron: rank {self.rank} watchdog error: {type(exc).__name__}: {exc}")
                    warned = True

    def _poll_store(self, seen: dict) -> None:
        s, r = self._store, self.rank
        self._op(s.add, f"hb/{r}", 1)
        if self._op(s.check, ["failed"]):
            code, msg = _unpack(self._op(s.get, "failed"))
            self._end(msg, mine=False, code=code)
        if self._local and (gone := self._local.gone(self._op, s, _DONE)):
            self._end(f"rank {gone[0]} died {self._peer_step(gone[0])}: its process {gone[1]} is gone (killed or "
                      f"crashed; noticed by rank {r} on its machine)", mine=False, dead=1)
        now, watched, silent = time.monotonic(), 0, []     # silent: (seconds, peer, its limit)
        for i in range(1, self.world):
            p = (r + i) % self.world
            beat = self._op(s.add, f"hb/{p}", 0)
            if beat >= _DONE:
                continue
            last, since = seen.get(p, (None, now))
            if beat != last:
                seen[p] = (beat, now)
            else:
                # a peer not yet in its Watchdog may still be loading or compiling
                silent.append((now - since, p, self.peer_timeout_s if beat > 0 else self.first_step_timeout_s))
            watched += 1
            if watched == _WATCHED:
                break
        if over := [x for x in silent if x[0] > x[2]]:   # peers dying together: heartbeats cannot order them
            gone, p, _ = max(over)
            also = [f"rank {q} for {t:.0f} s" for t, q, _ in silent if q != p and t > 2 * self.poll_s]
            self._end(f"rank {p} stopped responding {self._peer_step(p)}: no heartbeat for {gone:.0f} s (killed, "
                      f"crashed, or frozen; noticed by rank {r}){'; also silent: ' + ', '.join(also) if also else ''}",
                      mine=False, dead=1 + len(also))

    def _peer_step(self, p: int) -> str:
        if self._op(self._store.check, [f"step/{p}"]):
            return f"at step {self._op(self._store.get, f'step/{p}').decode()}"
        return "before its first step"

    def _check_self(self) -> None:
        if self._quiet:
            return
        step, since, allow = self._state
        stalled = time.monotonic() - since
        if stalled <= allow:
            return
        frame = sys._current_frames().get(self._loop_ident)
        waiting = "in a collective" if _in_collective(frame) else (
            "on the GPU" if _gpu_busy(self._device) else None)
        if waiting and self._store is not None and stalled <= allow + self.peer_timeout_s + 2 * self.poll_s:
            return
        where = f"in step {step}" if step is not None else "before its first step"
        self._end(f"rank {self.rank} stalled {where} for {stalled:.0f} s (allowed {allow:g} s)"
                  f"{', waiting ' + waiting if waiting else ''}; loop thread at {_stack_line(frame)}")
