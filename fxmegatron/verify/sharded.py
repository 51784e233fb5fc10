"""Sharded data parallelism under ``verify``: every replica's ranks run at once
(``simulate.run_mesh``) over a simulated dp × cp group.

Under ``dp_shard="full"`` their ``unshard`` nodes gather and reduce-scatter over it, and each
parameter's gradient is put back together from the ranks' shards (``join_dp_shards``).
Under "optimizer" and "gradients" the graphs are those of "none" and the runtime's own
``GradSync`` reduces the buckets over it (``RuntimeReduction``), a launch per step or per
microbatch, into each rank's pieces, from which every rank's whole gradients are gathered.

A shard's ``.grad`` is already the reduce-scatter of every replica's and cp rank's gradient,
divided by dp (``ops.dp_gather``): the whole gradient is the dp × cp ranks' shards one after
the other (dp-major, as the group's ranks), cut to the parameter's local shape. What the
comparison then sees is what ``GradSync`` and ``sum_over_cp`` give without sharding."""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from fxmegatron.errors import VerificationError
from fxmegatron.ops.dp_gather import whole
from fxmegatron.runtime.data_parallel import GradSync
from fxmegatron.runtime.sharded_dp import SHARDED_OPTIMIZER


def check_simulated(lay) -> None:
    """Refuse what is not simulated: ep with a sharded optimizer or parameters (the experts' pieces
    are reduced, and under "full" sharded, over their own group, not over dp as
    ``RuntimeReduction`` and ``join_dp_shards`` take every piece)."""
    if lay.ep > 1 and lay.dp_shard != "none":
        raise VerificationError(f"verify(ep={lay.ep}, dp_shard={lay.dp_shard!r}): not simulated yet (the experts' "
                                "pieces are reduced over their own group); verify the layout with dp_shard='none': "
                                "the sharded optimizer changes no gradient, only where each piece is kept")


def join_dp_shards(grads: Sequence[Sequence[Mapping[str, torch.Tensor]]], shapes: Mapping[str, Sequence[int]]
                   ) -> List[Dict[str, torch.Tensor]]:
    """Per pipeline rank, each parameter's whole local gradient from ``grads[k][r]``: the
    gradients of the dp × cp group's rank ``k`` (dp-major) on pipeline rank ``r``. A parameter
    not in ``shapes`` (not sharded) is the same on every rank: rank 0's."""
    out = []
    for r in range(len(grads[0])):
        joined = {}
        for name, g in grads[0][r].items():
            if name not in shapes:
                joined[name] = g
                continue
            parts = [per[r].get(name) for per in grads]
            if any(p is None for p in parts):     # a rank whose shard got no gradient: its reduce-scatter was skipped
                continue
            joined[name] = whole(torch.cat([p.reshape(-1) for p in parts]), shapes[name])
        out.append(joined)
    return out


class RuntimeReduction:
    """``GradSync`` as ``ParallelModel`` builds it for ``dp_shard`` "optimizer" or "gradients"
    (sharded buckets, the sum over the group divided by dp, a tied weight's bucket alone), one
    per pipeline rank of a simulated rank's program ``prog``, over the simulated group
    ``group_name`` of ``world`` ranks, of which this is rank ``rank`` (and, under hybrid
    sharding, each piece all-reduced over the simulated group ``replicas``)."""

    def __init__(self, prog, mode: str, group_name: str, world: int, dp: int, rank: int, replicas: str = ""):
        self.prog = prog
        pp = len(prog.params)
        self.syncs = []
        for r, held in enumerate(prog.params):
            mine = [m for c, m in prog.modules.items() if c % pp == r]
            uses = {id(p): sum(any(q is p for q in m.parameters()) for m in mine) for p in held.values()}
            alone = {id(held[n]) for n in prog.shared if n in held}
            self.syncs.append(GradSync(list(held.values()), uses, group_name, world, divisor=dp, shard=True,
                                       rank=rank, alone=alone, every_microbatch=mode == "gradients",
                                       replicas=replicas or None))

    def start(self, microbatches: int) -> None:
        for s in self.syncs:
            s.start(microbatches)

    def finish(self) -> List[Dict[str, torch.Tensor]]:
        """Per pipeline rank, each parameter's reduced gradient, gathered from every rank's pieces."""
        out = []
        for s, held in zip(self.syncs, self.prog.params):
            s.finish()
            reduced = s.whole_grads()
            s.remove()
            out.append({n: reduced[id(p)].clone() for n, p in held.items() if id(p) in reduced})
        return out
