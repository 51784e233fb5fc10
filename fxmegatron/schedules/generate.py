"""Generators for GPipe, 1F1B and Megatron's interleaved 1F1B schedules.

Each generator first decides, per rank, the order of its F/B computes (the
part that distinguishes the schedules) and then :func:`add_communication`
inserts the sends and recvs the same way for all of them: each ``RECV`` just
before the compute that needs it (as late as possible) and each ``SEND`` right
after the compute that produces it.  With non-blocking sends this placement
never adds a wait the compute order does not already imply, so it cannot
deadlock unless the compute order itself is cyclic (the simulator checks).

Constraints (raise :class:`ScheduleError`):

* ``p >= 1``, ``v >= 1``, ``m >= 1``, all ints;
* ``"1f1b"`` needs ``v == 1`` (use ``"interleaved"`` for ``v > 1``);
* ``"interleaved"`` with ``v > 1`` needs ``m % p == 0`` (Megatron's
  constraint: microbatches go through the chunks in groups of ``p``);
* ``"interleaved"`` with ``v == 1`` is *allowed* and returns exactly the
  1F1B schedule (named ``"1f1b"``): Megatron's interleaved warmup formula with
  one chunk would only double the warmup (more memory, same bubble).
"""
from __future__ import annotations

from fxmegatron.schedules.actions import Action, Schedule, ScheduleError

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")

# (kind, microbatch, global chunk): a compute before communication is added.
Compute = tuple[str, int, int]


def _check_sizes(p, v, m) -> None:
    for label, value in (("p (pipeline ranks)", p), ("v (model chunks per rank)", v),
                         ("m (microbatches)", m)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScheduleError(f"{label} must be an int, got {value!r}")
        if value < 1:
            raise ScheduleError(f"{label} must be >= 1, got {value}")


def add_communication(r: int, p: int, v: int, order: list[Compute]) -> list[Action]:
    """Turn rank ``r``'s compute order into actions with sends and recvs.

    RECV goes right before the consuming compute, SEND right after the
    producing one; chunk numbering follows the convention in ``actions.py``.
    """
    last = p * v - 1
    out: list[Action] = []
    for kind, i, c in order:
        if kind == "F" and c > 0 and (c - 1) % p != r:
            out.append(Action("RECV_F", i, c, peer=(c - 1) % p))
        if kind == "B" and c < last and (c + 1) % p != r:
            out.append(Action("RECV_B", i, c, peer=(c + 1) % p))
        out.append(Action(kind, i, c))
        if kind == "F" and c < last and (c + 1) % p != r:
            out.append(Action("SEND_F", i, c, peer=(c + 1) % p))
        if kind == "B" and c > 0 and (c - 1) % p != r:
            out.append(Action("SEND_B", i, c, peer=(c - 1) % p))
    return out


def _build(name: str, p: int, v: int, m: int, order_for_rank) -> Schedule:
    ranks = [add_communication(r, p, v, order_for_rank(r)) for r in range(p)]
    return Schedule(name=name, p=p, v=v, m=m, ranks=ranks)


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe: every forward, then every backward.

    Rank ``r`` runs its local chunks in turn (``r, r+p, ...``), all ``m``
    microbatches per chunk; backwards visit its chunks in reverse order,
    microbatches ascending.  Sorting computes by (chunk, microbatch) is a
    global topological order, so this never deadlocks for any ``v``.
    """
    _check_sizes(p, v, m)

    def order(r: int) -> list[Compute]:
        chunks = [j * p + r for j in range(v)]
        fwd = [("F", i, c) for c in chunks for i in range(m)]
        bwd = [("B", i, c) for c in reversed(chunks) for i in range(m)]
        return fwd + bwd

    return _build("gpipe", p, v, m, order)


def _one_f_one_b_order(p: int, m: int, r: int) -> list[Compute]:
    """Megatron ``forward_backward_pipelining_without_interleaving``:
    ``min(p - r - 1, m)`` warmup forwards, then alternate F/B, then drain."""
    warmup = min(p - r - 1, m)
    order: list[Compute] = [("F", i, r) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k, r), ("B", k, r)]
    order += [("B", k, r) for k in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """Megatron's non-interleaved 1F1B schedule (PipeDream-Flush), ``v == 1``."""
    _check_sizes(p, 1, m)
    return _build("1f1b", p, 1, m, lambda r: _one_f_one_b_order(p, m, r))


def interleaved_warmup(p: int, v: int, m: int, r: int) -> int:
    """Forwards rank ``r`` runs before its first backward in Megatron's
    interleaved schedule: all ``m*v`` when ``m == p``, else
    ``min((p - r - 1) * 2 + (v - 1) * p, m * v)``."""
    total = m * v
    if m == p:
        return total
    return min((p - r - 1) * 2 + (v - 1) * p, total)


def interleaved_microbatch(p: int, v: int, k: int) -> int:
    """Microbatch of the ``k``-th forward (or backward) on any rank: microbatches
    go in groups of ``p`` through all ``v`` local chunks before the next group."""
    return (k // (p * v)) * p + k % p


def interleaved_local_chunk(p: int, v: int, k: int, forward: bool) -> int:
    """Local chunk (0..v-1) of the ``k``-th forward/backward (Megatron's
    ``get_model_chunk_id``): backwards visit the chunks in reverse."""
    j = (k // p) % v
    return j if forward else v - 1 - j


def _interleaved_order(p: int, v: int, m: int, r: int) -> list[Compute]:
    def step(kind: str, k: int) -> Compute:
        j = interleaved_local_chunk(p, v, k, forward=(kind == "F"))
        return (kind, interleaved_microbatch(p, v, k), j * p + r)

    total, warmup = m * v, interleaved_warmup(p, v, m, r)
    order = [step("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [step("F", warmup + k), step("B", k)]
    order += [step("B", k) for k in range(total - warmup, total)]
    return order


def interleaved_1f1b(p: int, v: int, m: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021,
    ``forward_backward_pipelining_with_interleaving``).

    Rank ``r`` holds ``v`` chunks; its ``k``-th forward is microbatch
    :func:`interleaved_microbatch` on local chunk ``(k // p) % v`` (global chunk
    ``local * p + r``); after :func:`interleaved_warmup` forwards it alternates
    one forward, one backward, then drains the backwards.  ``v == 1`` returns
    :func:`one_f_one_b`.  Needs ``m % p == 0`` when ``v > 1``.
    """
    _check_sizes(p, v, m)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p != 0:
        raise ScheduleError(
            f"interleaved schedule needs m % p == 0 (microbatches run through the chunks "
            f"in groups of p, as in Megatron-LM); got m={m}, p={p}")
    return _build("interleaved", p, v, m, lambda r: _interleaved_order(p, v, m, r))


def forward_only(schedule: Schedule) -> Schedule:
    """The evaluation schedule of ``schedule``: each rank runs its forwards in the order
    ``schedule`` runs them, and nothing else (no backward, no gradient sends).

    Dropping the backwards removes only waits: every cross-rank dependency left (a RECV_F
    on its SEND_F) is one the training schedule has too, so this cannot deadlock where
    ``schedule`` does not. Keeping the training order, not e.g. microbatch-major order,
    keeps its overlap: interleaved ranks pass groups of p microbatches along the ring.
    """
    if schedule.forward_only:
        return schedule
    p, v, m = schedule.p, schedule.v, schedule.m

    def order(r: int) -> list[Compute]:
        return [(a.kind, a.microbatch, a.chunk) for a in schedule.computes(r) if a.kind == "F"]

    ranks = [add_communication(r, p, v, order(r)) for r in range(p)]
    return Schedule(name=f"{schedule.name}-forward", p=p, v=v, m=m, ranks=ranks, forward_only=True)


def make_schedule(name: str, p: int, v: int, m: int) -> Schedule:
    """Build schedule ``name`` (one of ``gpipe``, ``1f1b``, ``interleaved``)."""
    if name == "gpipe":
        return gpipe(p, m, v)
    if name == "1f1b":
        _check_sizes(p, v, m)
        if v != 1:
            raise ScheduleError(
                f"1f1b is the non-interleaved schedule and needs v == 1, got v={v}; "
                "use 'interleaved' for v > 1")
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, v, m)
    raise ScheduleError(f"unknown schedule {name!r}; choose one of {SCHEDULE_NAMES}")
