"""An event-driven simulator that is the judge of a schedule's validity.

Each rank executes its action list in order, each action as soon as possible:

* ``F``/``B`` of one chunk cost ``f_time / v`` and ``b_time / v`` (so a whole
  stage's forward costs ``f_time`` whatever ``v`` is);
* ``SEND`` costs nothing and is non-blocking: it is *posted* at the rank's
  current time;
* ``RECV`` costs nothing and blocks: it completes at
  ``max(rank's time, time the matching SEND was posted)``.

A compute never waits on another rank directly: its inputs must already be on
this rank (an earlier local compute, or an earlier ``RECV`` in this rank's
list), otherwise the schedule is wrong, not merely slow.  Only ``RECV`` waits,
so a deadlock is a cycle of ``RECV``s; it is reported with each stuck rank's
next action.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fxmegatron.schedules.actions import Action, Schedule, ScheduleError

# (direction, microbatch, producing chunk, src rank, dst rank)
PairKey = tuple[str, int, int, int, int]


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    ``busy[r]``: total compute time of rank ``r`` (``m * (f_time + b_time)``
    for every rank of a complete schedule).

    ``bubble_fraction[r] = (makespan - busy[r]) / busy[r]``: idle time over
    compute time.  It equals exactly ``(p-1)/m`` for GPipe (``v == 1``) and
    1F1B, and ``(p-1)/(v*m)`` for interleaved 1F1B, for any ``f_time`` and
    ``b_time`` (checked exhaustively for p <= 8, v <= 4, m <= 32 and several
    f/b ratios, including b = 2f and f/b far from 1).  GPipe with ``v > 1``
    (chunk-major order) gives ``(max(m + (p-1)/v, p + (m-1)/v) - m) / m``,
    i.e. ``(p-1)/(v*m)`` when ``m >= p``.

    ``peak_in_flight[r]``: the maximum, over rank ``r``'s execution, of the
    number of distinct microbatches ``i`` such that some ``F(i, c)`` on rank
    ``r`` has started and not all of rank ``r``'s ``v`` chunks have completed
    ``B(i, c)``.  A microbatch enters when its first forward on this rank
    starts and leaves when its last backward on this rank completes; this is
    the number of microbatches whose activations rank ``r`` holds at once.

    ``peak_in_flight_chunks[r]``: the same for (microbatch, chunk) pairs:
    ``F(i, c)`` started, ``B(i, c)`` not complete (activation memory in units
    of one chunk, i.e. ``1/v`` of a stage).

    A forward-only schedule keeps nothing for a backward: both peaks are 0, and
    ``busy[r]`` is ``m * f_time``.

    ``timeline[r]``: ``(start, end, action)`` for each compute of rank ``r``.
    """

    name: str
    p: int
    v: int
    m: int
    makespan: float
    busy: list[float]
    bubble_fraction: list[float]
    peak_in_flight: list[int]
    peak_in_flight_chunks: list[int]
    timeline: list[list[tuple[float, float, Action]]] = field(repr=False)

    @property
    def overall_bubble_fraction(self) -> float:
        """Idle over compute time summed over all ranks."""
        total_busy = sum(self.busy)
        return (self.p * self.makespan - total_busy) / total_busy

    @property
    def max_peak_in_flight(self) -> int:
        return max(self.peak_in_flight)


def _where(r: int, idx: int, a: Action) -> str:
    return f"rank {r}, action #{idx} {a.kind}(microbatch={a.microbatch}, chunk={a.chunk}" + (
        f", peer={a.peer})" if a.peer is not None else ")")


def _expected_peer(a: Action, p: int, last: int) -> int | None:
    """The rank the data of a send/recv must go to / come from, or None when
    the action makes no sense at that chunk (no next/previous chunk)."""
    if a.kind == "SEND_F":
        return (a.chunk + 1) % p if a.chunk < last else None
    if a.kind == "RECV_F":
        return (a.chunk - 1) % p if a.chunk > 0 else None
    if a.kind == "SEND_B":
        return (a.chunk - 1) % p if a.chunk > 0 else None
    return (a.chunk + 1) % p if a.chunk < last else None  # RECV_B


def pair_key(r: int, a: Action) -> PairKey:
    """Key under which a send on rank ``r`` and its recv on the peer match:
    (direction, microbatch, producing chunk, src rank, dst rank)."""
    direction = a.kind[-1]
    if a.is_send:
        return (direction, a.microbatch, a.chunk, r, a.peer)
    produced = a.chunk - 1 if direction == "F" else a.chunk + 1
    return (direction, a.microbatch, produced, a.peer, r)


def _check_action(s: Schedule, r: int, idx: int, a: Action) -> None:
    """Ranges, placement (chunk c on rank c % p) and peers of one action."""
    last = s.num_chunks - 1
    if not 0 <= a.microbatch < s.m:
        raise ScheduleError(f"{_where(r, idx, a)}: microbatch out of range 0..{s.m - 1}")
    if not 0 <= a.chunk <= last:
        raise ScheduleError(f"{_where(r, idx, a)}: chunk out of range 0..{last}")
    if a.chunk % s.p != r:
        raise ScheduleError(
            f"{_where(r, idx, a)}: chunk {a.chunk} lives on rank {a.chunk % s.p}, not {r}")
    if s.forward_only and a.kind[-1] == "B":
        raise ScheduleError(f"{_where(r, idx, a)}: {a.kind} in a forward-only schedule")
    if a.is_compute:
        return
    peer = _expected_peer(a, s.p, last)
    if peer is None:
        raise ScheduleError(f"{_where(r, idx, a)}: {a.kind} at the end of the chunk chain")
    if peer == r:
        raise ScheduleError(
            f"{_where(r, idx, a)}: the neighbouring chunk is on this same rank; "
            "it is handed off locally, no send/recv expected")
    if a.peer != peer:
        raise ScheduleError(f"{_where(r, idx, a)}: wrong peer {a.peer}, expected rank {peer}")


def _check_computes(s: Schedule) -> None:
    """Every (microbatch, chunk) has exactly one F and one B (no B when forward-only) on its
    rank."""
    seen: set[tuple[str, int, int]] = set()
    for r, acts in enumerate(s.ranks):
        for idx, a in enumerate(acts):
            key = (a.kind, a.microbatch, a.chunk)
            if a.is_compute and key in seen:
                raise ScheduleError(f"{_where(r, idx, a)}: duplicate compute")
            seen.add(key)
    for kind in ("F",) if s.forward_only else ("F", "B"):
        for i in range(s.m):
            for c in range(s.num_chunks):
                if (kind, i, c) not in seen:
                    raise ScheduleError(
                        f"missing compute {kind}(microbatch={i}, chunk={c}) on rank {c % s.p}")


def _check_pairs(s: Schedule) -> None:
    """Every send has exactly one matching recv and vice versa."""
    sends: dict[PairKey, tuple[int, int, Action]] = {}
    recvs: dict[PairKey, tuple[int, int, Action]] = {}
    for r, acts in enumerate(s.ranks):
        for idx, a in enumerate(acts):
            if a.is_compute:
                continue
            table = sends if a.is_send else recvs
            key = pair_key(r, a)
            if key in table:
                raise ScheduleError(f"{_where(r, idx, a)}: duplicate {a.kind}")
            table[key] = (r, idx, a)
    for mine, other, missing in ((sends, recvs, "RECV"), (recvs, sends, "SEND")):
        for key, (r, idx, a) in mine.items():
            if key not in other:
                raise ScheduleError(f"{_where(r, idx, a)}: no matching {missing}_{key[0]} "
                                    f"on rank {a.peer}")


def check_static(s: Schedule) -> None:
    """All checks that do not need time: shape, placement, peers, computes, pairs."""
    if len(s.ranks) != s.p:
        raise ScheduleError(f"schedule has {len(s.ranks)} rank lists, expected p={s.p}")
    for r, acts in enumerate(s.ranks):
        for idx, a in enumerate(acts):
            _check_action(s, r, idx, a)
    _check_computes(s)
    _check_pairs(s)


class _Rank:
    """Execution state of one rank: program counter, clock, what it holds."""

    def __init__(self, actions: list[Action]):
        self.actions = actions
        self.pc = 0
        self.clock = 0.0
        self.busy = 0.0
        self.done: set[tuple[str, int, int]] = set()  # computes and recvs done here
        self.live_chunks: set[tuple[int, int]] = set()
        self.live_bwd_left: dict[int, int] = {}  # microbatch -> chunks without B yet
        self.peak_mb = 0
        self.peak_chunks = 0
        self.timeline: list[tuple[float, float, Action]] = []

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.actions)


class _Simulator:
    def __init__(self, s: Schedule, f_time: float, b_time: float):
        self.s = s
        self.last = s.num_chunks - 1
        self.cost = {"F": f_time / s.v, "B": b_time / s.v}
        self.ranks = [_Rank(acts) for acts in s.ranks]
        self.posted: dict[PairKey, float] = {}

    def run(self) -> None:
        while not all(rk.finished for rk in self.ranks):
            progressed = False
            for r, rk in enumerate(self.ranks):
                while not rk.finished and self._step(r, rk, rk.actions[rk.pc]):
                    rk.pc += 1
                    progressed = True
            if not progressed:
                self._raise_deadlock()

    def _step(self, r: int, rk: _Rank, a: Action) -> bool:
        """Execute ``a`` if it can run now; False only for a RECV still waiting."""
        if a.is_compute:
            self._check_inputs(r, rk, a)
            self._compute(rk, a)
        elif a.is_send:
            if ("F" if a.kind == "SEND_F" else "B", a.microbatch, a.chunk) not in rk.done:
                raise ScheduleError(f"{_where(r, rk.pc, a)}: sends data before the compute "
                                    "that produces it")
            self.posted[pair_key(r, a)] = rk.clock
        else:
            posted = self.posted.get(pair_key(r, a))
            if posted is None:
                return False
            rk.clock = max(rk.clock, posted)
            rk.done.add((a.kind, a.microbatch, a.chunk))
        return True

    def _check_inputs(self, r: int, rk: _Rank, a: Action) -> None:
        i, c, p = a.microbatch, a.chunk, self.s.p
        if a.kind == "F":
            if c == 0:
                return
            need = ("F", i, c - 1) if (c - 1) % p == r else ("RECV_F", i, c)
        else:
            if ("F", i, c) not in rk.done:
                raise ScheduleError(f"{_where(r, rk.pc, a)}: backward before its forward "
                                    f"F(microbatch={i}, chunk={c}) on this rank")
            if c == self.last:
                return
            need = ("B", i, c + 1) if (c + 1) % p == r else ("RECV_B", i, c)
        if need not in rk.done:
            raise ScheduleError(
                f"{_where(r, rk.pc, a)}: input not available: needs {need[0]}"
                f"(microbatch={need[1]}, chunk={need[2]}) earlier on this rank")

    def _compute(self, rk: _Rank, a: Action) -> None:
        start, cost = rk.clock, self.cost[a.kind]
        rk.clock = start + cost
        rk.busy += cost
        rk.timeline.append((start, rk.clock, a))
        rk.done.add((a.kind, a.microbatch, a.chunk))
        if not self.s.forward_only:
            self._track_in_flight(rk, a)

    def _track_in_flight(self, rk: _Rank, a: Action) -> None:
        i = a.microbatch
        if a.kind == "F":
            rk.live_chunks.add((i, a.chunk))
            rk.live_bwd_left.setdefault(i, self.s.v)
            rk.peak_chunks = max(rk.peak_chunks, len(rk.live_chunks))
            rk.peak_mb = max(rk.peak_mb, len(rk.live_bwd_left))
            return
        rk.live_chunks.discard((i, a.chunk))
        rk.live_bwd_left[i] -= 1
        if rk.live_bwd_left[i] == 0:
            del rk.live_bwd_left[i]

    def _raise_deadlock(self):
        stuck = []
        for r, rk in enumerate(self.ranks):
            if rk.finished:
                continue
            a = rk.actions[rk.pc]
            stuck.append(f"{_where(r, rk.pc, a)} waits for SEND_{a.kind[-1]} from rank {a.peer}")
        raise ScheduleError("deadlock: no rank can make progress; " + "; ".join(stuck))

    def result(self) -> SimResult:
        s, ranks = self.s, self.ranks
        makespan = max(rk.clock for rk in ranks)
        busy = [rk.busy for rk in ranks]
        return SimResult(
            name=s.name, p=s.p, v=s.v, m=s.m, makespan=makespan, busy=busy,
            bubble_fraction=[(makespan - b) / b for b in busy],
            peak_in_flight=[rk.peak_mb for rk in ranks],
            peak_in_flight_chunks=[rk.peak_chunks for rk in ranks],
            timeline=[rk.timeline for rk in ranks])


def simulate(schedule: Schedule, f_time: float = 1.0, b_time: float = 1.0) -> SimResult:
    """Run ``schedule`` on the idealised machine described in the module
    docstring and return timings and memory figures (see :class:`SimResult`).

    Raises :class:`ScheduleError`, naming rank, action index and action, if a
    compute lacks its input (F without the previous chunk's output or RECV_F;
    B before its F or without the next chunk's gradient or RECV_B), a compute
    is duplicated or missing, a send/recv is unmatched or has the wrong peer,
    or the ranks deadlock.
    """
    if not (f_time > 0 and b_time > 0):
        raise ScheduleError(f"f_time and b_time must be > 0, got {f_time}, {b_time}")
    check_static(schedule)
    sim = _Simulator(schedule, f_time, b_time)
    sim.run()
    return sim.result()
