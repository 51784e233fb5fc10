"""Who a collective talks to: a group name resolved to a communicator.

Graph nodes carry a group *name* (a string, as torch's functional collectives do),
so graphs stay plain data that fake tensors, export and compile can read. At run time
the name resolves to one of:

* ``""``: a group of one, where every collective is the identity (``None`` here);
* a torch.distributed process group's name (``ProcessGroupComm``);
* ``"sim:<group>:<rank>"``: one rank of a group simulated in this process, each rank a
  thread (``SimulatedGroup``). ``fxmegatron.verify`` runs every rank of a layout this
  way, so a layout can be checked on one CPU without a cluster.

A communicator's collectives return new tensors and never write into their input.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def resolve_group(group_name: str):
    """The torch.distributed process group named ``group_name`` (None for ``""``)."""
    if group_name.startswith("@"):
        raise RuntimeError(f"group {group_name!r} is a symbolic name of generated stage code: "
                           "fxmegatron.io.stage_folder.load_folder binds it when it loads the code")
    if not group_name:
        return None
    if group_name.startswith("sim:"):
        raise RuntimeError(f"group {group_name!r} is simulated in this process: this op has no simulated form "
                           "(verify runs layouts without tp_comm_overlap)")
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


def nccl_like(pg) -> bool:
    return dist.get_backend(pg) != "gloo"


class ProcessGroupComm:
    """Collectives over a torch.distributed process group."""

    def __init__(self, pg):
        self.pg = pg
        self.size = dist.get_world_size(pg)
        self.rank = dist.get_rank(pg)

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=_OPS[op], group=self.pg)
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        """[world, *x.shape]: every rank's ``x``, in group order."""
        x = x.contiguous()
        out = x.new_empty((self.size,) + tuple(x.shape))
        if nccl_like(self.pg):
            dist.all_gather_into_tensor(out, x, group=self.pg)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.pg)
        return out

    def reduce_scatter(self, pieces: Tensor) -> Tensor:
        """``pieces`` [world, ...]: piece r summed over ranks, on rank r."""
        if nccl_like(self.pg):
            out = pieces.new_empty(pieces.shape[1:])
            dist.reduce_scatter_tensor(out, pieces.contiguous(), group=self.pg)
            return out
        # gloo has no reduce-scatter: all-reduce, keep our piece (CPU only)
        return self.all_reduce(pieces)[self.rank].clone()


class SimulatedGroup:
    """``size`` ranks of one group, each run by its own thread of this process. A collective
    is an exchange: every rank puts its tensor in its slot and waits for the others; the
    results are computed from the slots in rank order, so every rank gets the same bits.
    If a rank fails, ``abort()`` wakes the others with ``threading.BrokenBarrierError``."""

    _ids = itertools.count()
    _live: "weakref.WeakValueDictionary[int, SimulatedGroup]" = weakref.WeakValueDictionary()

    def __init__(self, size: int, timeout: float = 120.0):
        self.size = size
        self.id = next(self._ids)
        self._slots: List[Optional[Tensor]] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)
        SimulatedGroup._live[self.id] = self

    def name(self, rank: int) -> str:
        return f"sim:{self.id}:{rank}"

    def abort(self) -> None:
        self._barrier.abort()

    def exchange(self, rank: int, x: Tensor) -> List[Tensor]:
        # a copy: a rank may write over its tensor as soon as it has its result (GradSync's
        # in-place all-reduce does) while another still reads it
        self._slots[rank] = x.detach().clone()
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()     # nobody refills a slot before every rank has read them all
        return got


class SimulatedComm:
    def __init__(self, group: SimulatedGroup, rank: int):
        self.group, self.size, self.rank = group, group.size, rank

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        parts = self.group.exchange(self.rank, x.contiguous())
        out = parts[0].clone()
        for p in parts[1:]:
            out = out + p if op == "sum" else torch.maximum(out, p)
        return out

    def all_gather(self, x: Tensor) -> Tensor:
        return torch.stack(self.group.exchange(self.rank, x.contiguous()))

    def reduce_scatter(self, pieces: Tensor) -> Tensor:
        return self.all_reduce(pieces)[self.rank].clone()

    def shift(self, x: Tensor, send_to: int, recv_from: int) -> "_Arrived":
        """Context-parallel attention's P2P step (``ProcessGroupTransport.shift``): ``x`` to rank
        ``send_to``, what rank ``recv_from`` sent back. Every rank of the ring shifts at the same
        step, so one exchange serves them all; the destinations go round too, so that a plan whose
        ranks disagree on who sends to whom fails here instead of reading another rank's message."""
        got = self.group.exchange(self.rank, x.contiguous())
        dest = self.group.exchange(self.rank, torch.tensor(send_to))
        if int(dest[recv_from]) != self.rank:
            raise RuntimeError(f"simulated rank {self.rank} receives from rank {recv_from}, which sent to rank "
                               f"{int(dest[recv_from])}: the ranks' exchange plans are out of step")
        return _Arrived(got[recv_from].clone())


class _Arrived:
    """A shift that has already happened: ``wait()`` gives what came."""

    def __init__(self, received: Tensor):
        self.received = received

    def wait(self) -> Tensor:
        return self.received


def communicator(group_name: str):
    """The communicator behind ``group_name``, or None where collectives are identities."""
    if group_name.startswith("sim:"):
        _, gid, rank = group_name.split(":")
        group = SimulatedGroup._live.get(int(gid))
        if group is None:
            raise RuntimeError(f"simulated group {group_name!r} no longer exists")
        return SimulatedComm(group, int(rank)) if group.size > 1 else None
    pg = resolve_group(group_name)
    if pg is None or dist.get_world_size(pg) == 1:
        return None
    return ProcessGroupComm(pg)
