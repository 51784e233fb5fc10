"""Pipeline schedules as pure data: what each pipeline rank does, in order.

A schedule is nothing but one ordered list of :class:`Action` per pipeline
rank. Keeping it as data (rather than as code that calls send/recv) lets the
same object be checked by :func:`fxmegatron.schedules.simulate.simulate`,
drawn by :mod:`fxmegatron.schedules.draw` and executed by a runtime.

Placement convention (Megatron's interleaved placement)
------------------------------------------------------
There are ``p`` pipeline ranks and ``p * v`` model chunks.  Chunk ``c`` lives
on rank ``c % p``, so rank ``r`` owns chunks ``r, r + p, ..., r + (v-1)*p``.
The forward of microbatch ``i`` runs chunks ``0, 1, ..., p*v - 1`` in order;
its backward runs them in reverse.

Chunk field of send/recv actions
--------------------------------
``SEND_*`` carries the chunk that *produced* the data; ``RECV_*`` carries the
chunk the data is *for* on the receiving rank:

* after ``F(i, c)`` on rank ``r`` (``c < p*v - 1``, next chunk remote):
  rank ``r`` has ``SEND_F(i, c, peer=(c+1) % p)`` and the peer has
  ``RECV_F(i, c+1, peer=r)`` before its ``F(i, c+1)``;
* after ``B(i, c)`` on rank ``r`` (``c > 0``, previous chunk remote):
  rank ``r`` has ``SEND_B(i, c, peer=(c-1) % p)`` and the peer has
  ``RECV_B(i, c-1, peer=r)`` before its ``B(i, c-1)``.

So every action's ``chunk`` is a chunk owned by the rank whose list holds it.
With ``p == 1`` there are no sends or recvs: chunks hand off locally.

Runtime model
-------------
Each rank executes its list in order.  ``SEND`` is non-blocking (posted, it
completes later); ``RECV`` blocks until the matching ``SEND`` has been posted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fxmegatron.errors import ScheduleError

COMPUTE_KINDS = ("F", "B")
SEND_KINDS = ("SEND_F", "SEND_B")
RECV_KINDS = ("RECV_F", "RECV_B")
KINDS = COMPUTE_KINDS + SEND_KINDS + RECV_KINDS

# Short tags for the compact text form (see Schedule.__str__).
_SHORT = {"F": "F", "B": "B", "SEND_F": "sF", "SEND_B": "sB",
          "RECV_F": "rF", "RECV_B": "rB"}



@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    ``kind`` is one of ``F, B, SEND_F, RECV_F, SEND_B, RECV_B``; ``microbatch``
    the microbatch index; ``chunk`` the *global* model-chunk index
    (``0 .. p*v-1``, see the module docstring for the send/recv convention);
    ``peer`` the other pipeline rank for sends/recvs and ``None`` for compute.
    """

    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"Action kind must be one of {KINDS}, got {self.kind!r}")
        is_comm = self.kind not in COMPUTE_KINDS
        if is_comm and self.peer is None:
            raise ScheduleError(f"{self.kind} needs a peer rank (got peer=None)")
        if not is_comm and self.peer is not None:
            raise ScheduleError(f"compute action {self.kind} takes no peer (got peer={self.peer})")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    def __str__(self) -> str:
        """Compact form: ``F3c2`` (forward of microbatch 3, chunk 2),
        ``sF3c2>1`` (send to rank 1), ``rF3c3<0`` (receive from rank 0)."""
        tag = f"{_SHORT[self.kind]}{self.microbatch}c{self.chunk}"
        if self.is_send:
            return f"{tag}>{self.peer}"
        if self.is_recv:
            return f"{tag}<{self.peer}"
        return tag


@dataclass
class Schedule:
    """A whole pipeline schedule: ``ranks[r]`` is rank ``r``'s ordered actions.

    ``p`` pipeline ranks, ``v`` model chunks per rank, ``m`` microbatches.
    ``forward_only``: an evaluation schedule (forwards and their sends/recvs only).
    """

    name: str
    p: int
    v: int
    m: int
    ranks: list[list[Action]] = field(default_factory=list)
    forward_only: bool = False

    @property
    def num_chunks(self) -> int:
        return self.p * self.v

    def computes(self, rank: int) -> list[Action]:
        """Rank ``rank``'s F/B actions only, in order (for drawing and tests)."""
        return [a for a in self.ranks[rank] if a.is_compute]

    def __str__(self) -> str:
        head = (f"{self.name} p={self.p} v={self.v} m={self.m} "
                "(Fic: forward of microbatch i on chunk c; sF/sB: send to >rank; "
                "rF/rB: recv from <rank)")
        width = len(str(max(self.p - 1, 0)))
        rows = [f"rank {r:>{width}}: " + " ".join(str(a) for a in acts)
                for r, acts in enumerate(self.ranks)]
        return "\n".join([head, *rows])
