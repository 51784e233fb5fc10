"""Every rank of a layout run in this process, one thread per rank.

The ranks' collectives go through a ``SimulatedGroup`` (``fxmegatron.ops.groups``):
each rank's graph is bound to the group name ``sim:<group>:<rank>``, and its f/g,
gathers, scatters and the vocab-parallel loss exchange tensors with the other
threads; under context parallelism a second group per tp rank carries the cp ops
(``cp_sum``, ``cp_count`` and the ring's P2P shifts or the all-gather of keys and
values in ``cp_attention``, forward and backward). Forward and backward are the real
ops with their real autograd formulas, so what runs is the rank program itself, not a
model of it. Each rank's forward
runs through an ``fx.Interpreter`` that records every node's value for the
comparison (``compare.py``).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List

import torch
import torch.fx as fx

from fxmegatron.ops.groups import SimulatedGroup


class Recorder(fx.Interpreter):
    """Runs a GraphModule and keeps a detached copy of each node's value, by node name."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: Dict[str, object] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op not in ("output", "get_attr"):
            self.values[n.name] = _detached(out)
        return out


def _detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    return x


def run_ranks(size: int, body: Callable[[int, str], object]) -> List[object]:
    """``body(rank, group_name)`` on ``size`` threads sharing one simulated group; the results
    by rank. An exception on any rank wakes the others and is raised here (the first one)."""
    return run_grid(1, size, lambda c, t, tp_name, cp_name: body(t, tp_name))


def run_grid(cp: int, tp: int, body: Callable[[int, int, str, str], object]) -> List[object]:
    """``body(cp_rank, tp_rank, tp_group_name, cp_group_name)`` on cp·tp threads: the ranks of one
    cp rank share a simulated tp group, those of one tp rank a cp group (the mesh's cp × tp).
    The results by rank, cp_rank·tp + tp_rank. An exception on any rank wakes the others and is
    raised here (the first one)."""
    return run_mesh(1, cp, tp, lambda d, c, t, names: body(c, t, names["tp"], names["cp"]))


def run_mesh(dp: int, cp: int, tp: int, body: Callable[[int, int, int, Dict[str, str]], object],
             replicate: int = 1, ep: int = 1) -> List[object]:
    """``body(dp_rank, cp_rank, tp_rank, group_names)`` on dp·cp·tp threads: a simulated tp group
    per (dp, cp) rank, a cp group per (dp, tp) rank and a "dp_cp" group per tp rank (its ranks
    dp-major, as the dp × cp group that sums gradients). ``replicate`` > 1 (hybrid sharding): the
    dp ranks cut in (replicate, dp / replicate) as ``mesh.mesh_axes`` cuts them, a "dp_cp" group
    per (tp rank, replica) and a "dp_replicate" group per (tp rank, place in a replica). ``ep`` > 1:
    an "ep" group per (tp rank, cp rank, ep consecutive dp ranks), as ``mesh.mesh_axes`` cuts dp. The
    results by rank, (dp_rank·cp + cp_rank)·tp + tp_rank. An exception on any rank wakes the
    others and is raised here (the first one)."""
    shard = dp // replicate
    tp_groups = [SimulatedGroup(tp) for _ in range(dp * cp)]
    cp_groups = [SimulatedGroup(cp) for _ in range(dp * tp)]
    dp_groups = [SimulatedGroup(shard * cp) for _ in range(tp * replicate)]
    rep_groups = [SimulatedGroup(replicate) for _ in range(tp * shard * cp)] if replicate > 1 else []
    ep_groups = [SimulatedGroup(ep) for _ in range(tp * cp * (dp // ep))] if ep > 1 else []
    results: List[object] = [None] * (dp * cp * tp)
    errors: List[BaseException] = []

    def target(d: int, c: int, t: int) -> None:
        names = {"tp": tp_groups[d * cp + c].name(t), "cp": cp_groups[d * tp + t].name(c),
                 "dp_cp": dp_groups[t * replicate + d // shard].name(d % shard * cp + c),
                 "dp_replicate": rep_groups[(t * shard + d % shard) * cp + c].name(d // shard) if rep_groups else "",
                 "ep": ep_groups[(t * cp + c) * (dp // ep) + d // ep].name(d % ep) if ep_groups else ""}
        try:
            with torch.random.fork_rng(devices=[]):
                results[(d * cp + c) * tp + t] = body(d, c, t, names)
        except threading.BrokenBarrierError as exc:
            if not errors:
                errors.append(exc)
        except BaseException as exc:   # noqa: B902 - reported on the caller's thread
            errors.insert(0, exc)
            for g in tp_groups + cp_groups + dp_groups + rep_groups + ep_groups:
                g.abort()

    threads = [threading.Thread(target=target, args=(d, c, t), name=f"fxmegatron-sim-rank{(d * cp + c) * tp + t}",
                                daemon=True) for d in range(dp) for c in range(cp) for t in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
