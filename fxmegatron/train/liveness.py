"""Whether a peer process on this machine still runs, read from the process table: what
torchrun's agent learns at once about a worker it started (it polls them every 0.1 s), known to
the worker's neighbours too, without waiting for heartbeats to go stale.

Each rank publishes ``identity()``: its machine (the boot id and the pid namespace, within which
pids mean one process), its pid and the process's start time (a reused pid is another process).
A peer whose identity names this machine and whose process is gone, a zombie or another process
has ended; one on another machine is not judged here (its own neighbours there judge it).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Tuple


def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:           # no /proc: pids are never compared
        return ""


def _started(pid: int) -> Optional[str]:
    """The start time of live process ``pid`` (field 22 of /proc/PID/stat), None when it is gone
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X", "x") else fields[19]


def identity() -> str:
    """This process, as ``LocalPeers`` on another process of this machine reads it."""
    return f"{_machine()} {os.getpid()} {_started(os.getpid())}"


class LocalPeers:
    """The peers of ``rank`` that may run on this machine: the two it watches (the next ranks)
    and, under torchrun, the ranks of its node (torchrun numbers a node's workers contiguously; a
    wrong guess costs nothing, as the published identity decides). Their identities are read from
    the watchdog's store (under ``pid/RANK``) once each."""

    def __init__(self, rank: int, world: int):
        local, n = int(os.environ.get("LOCAL_RANK", -1)), int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        node = range(rank - local, rank - local + n) if 0 <= local < n else range(0)
        watched = [(rank + 1) % world, (rank + 2) % world]
        self.rank = rank
        self.ranks = sorted({p for p in watched + list(node) if 0 <= p < world and p != rank})
        self.machine = _machine()
        self.known: Dict[int, Optional[Tuple[int, str]]] = {}    # rank -> (pid, start); None: elsewhere

    def publish(self, op: Callable, store) -> None:
        """``op(fn, *args)`` runs a store call (under the watchdog's lock)."""
        op(store.set, f"pid/{self.rank}", identity())

    def gone(self, op: Callable, store, done: int) -> Optional[Tuple[int, int]]:
        """(rank, pid) of the first peer whose process ended without leaving the loop cleanly
        (its heartbeat counter below ``done``), or None."""
        if not self.machine:
            return None
        for p in list(self.ranks):
            if p not in self.known:
                if not op(store.check, [f"pid/{p}"]):
                    continue         # not in its watchdog yet
                machine, pid, start = op(store.get, f"pid/{p}").decode().rsplit(" ", 2)
                self.known[p] = (int(pid), start) if machine == self.machine else None
            mine = self.known[p]
            if mine is not None and _started(mine[0]) != mine[1]:
                if op(store.add, f"hb/{p}", 0) < done:
                    return p, mine[0]
                self.ranks.remove(p)     # it finished and left
        return None
