"""``ShardedAdamW``: ``FusedAdamW`` on this data-parallel rank's share of the parameters
(``dp_shard="optimizer"``, ZeRO-1).

The data-parallel ranks each keep fp32 masters, m and v for the elements of their pieces of
the gradient buckets only (``runtime.sharded_dp``): a ``FusedAdamW`` over one tensor per
segment, each a view of its parameter's own storage, whose gradient is the segment's slice of
the reduce-scattered piece. The step updates those elements (the same AdamW, element by
element, as on the whole parameter: AdamW has no term across elements) and then all-gathers
every bucket so that each rank holds the whole updated parameters again. Per parameter
element a rank holds 12/world bytes of optimizer state instead of 12.

Hyperparameters are per group, as in ``FusedAdamW``: ``param_groups`` are the groups given
(with their whole parameters, which checkpoints name), and what is set there (an LR
scheduler's or the trainer's ``group["lr"]``) reaches the segments at the next step.
Checkpoints write each rank's segments as they are (``segment_state``; ``io.flat_pieces``) and
load whole per-parameter states (``load_state_dict``), so they load at any layout and mode."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from fxmegatron.optim.fused_adamw import FusedAdamW
from fxmegatron.runtime.sharded_dp import Segment, all_gather, bucket_layout, finish_gather, launch_gather


HYPER = ("lr", "betas", "eps", "weight_decay")


class ShardedAdamW:
    """AdamW over this rank's segments of ``grad_sync``'s buckets (module docstring). ``params``:
    the ParallelModel's parameters or groups of them, as for ``FusedAdamW``; every parameter
    ``grad_sync`` reduces must be in exactly one group.

    The buckets are stepped in chunks of about ``chunk_mb`` of parameters, one ``FusedAdamW``
    each: a chunk's all-gather is launched as soon as its update is, and runs while the next
    chunk's update does."""

    def __init__(self, grad_sync, params: Iterable, chunk_mb: float = 256.0, **hyper):
        # one GradSync, or several (expert parallelism: the experts' buckets are reduced over
        # their own group), each sharding its own buckets over its own group
        self.syncs = list(grad_sync) if isinstance(grad_sync, (list, tuple)) else [grad_sync]
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        group_of: Dict[int, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                if id(p) in group_of:
                    raise ValueError(f"ShardedAdamW: a parameter of shape {tuple(p.shape)} is in groups "
                                     f"{group_of[id(p)]} and {gi}")
                group_of[id(p)] = gi
        missing = [tuple(p.shape) for sync in self.syncs for p in sync.params if id(p) not in group_of]
        if missing:
            raise ValueError(f"ShardedAdamW: {len(missing)} parameter(s) the gradients are reduced for are in no "
                             f"group (shapes {missing[:3]}): the optimizer owns a share of every one")
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, **hyper}
        # torch's form: the groups with their (whole) parameters, which checkpoints name
        self.param_groups = [{**defaults, **{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                             for g in groups]
        self.steps_taken = 0
        # every sync's segments one after the other; ``_sync_of[i]``: segment i's sync
        self.segments: List[Segment] = [seg for sync in self.syncs for seg in sync.segments]
        self._sync_of = [k for k, sync in enumerate(self.syncs) for _ in sync.segments]
        # one leaf per segment, a view of its parameter's storage: the inner optimizer writes the
        # updated values there
        self._views = [nn.Parameter(s.param.detach().view(-1)[s.start:s.stop]) for s in self.segments]
        # chunks of whole buckets of one sync, in bucket order (the order backward finished them)
        self.chunks: List[List[int]] = []
        self._chunk_sync: List[int] = []                # per chunk: its sync's index
        for k, sync in enumerate(self.syncs):
            self.chunks.append([])
            self._chunk_sync.append(k)
            size = 0
            for b, bucket in enumerate(sync.buckets):
                self.chunks[-1].append(b)
                size += sum(p.numel() * p.element_size() for p in bucket)
                if size >= chunk_mb * 2**20 and b + 1 < len(sync.buckets):
                    self.chunks.append([])
                    self._chunk_sync.append(k)
                    size = 0
        chunk_of = {(self._chunk_sync[c], b): c for c, bs in enumerate(self.chunks) for b in bs}
        self._inner: List[Optional[FusedAdamW]] = []
        self._inner_group: List[List[int]] = []         # per chunk: its groups' indices in param_groups
        self._members: List[List[int]] = []             # per chunk: its segments' indices
        for k in range(len(self.chunks)):
            idx = [i for i, s in enumerate(self.segments) if chunk_of[(self._sync_of[i], s.bucket)] == k]
            by_group: Dict[int, list] = {}
            for i in idx:
                by_group.setdefault(group_of[id(self.segments[i].param)], []).append(self._views[i])
            gis = sorted(by_group)
            inner = FusedAdamW([{**{h: self.param_groups[gi][h] for h in HYPER}, "params": by_group[gi]}
                                for gi in gis]) if gis else None
            self._inner.append(inner)
            self._inner_group.append(gis)
            self._members.append(idx)
        # each segment's place in its chunk's optimizer: (chunk, index among its parameters)
        self._slot: Dict[int, tuple] = {}
        for k, inner in enumerate(self._inner):
            for j, v in enumerate(inner.params if inner is not None else ()):
                self._slot[id(v)] = (k, j)

    @torch.no_grad()
    def step(self, grad_scale: Union[Tensor, float, None] = None) -> None:
        """The segments' AdamW step on the reduced pieces (``grad_scale`` as in ``FusedAdamW``),
        then the all-gather of the parameters, chunk by chunk. Collective over the
        data-parallel group."""
        if any(self.syncs[k].pieces[s.bucket] is None for s, k in zip(self.segments, self._sync_of)):
            raise RuntimeError("ShardedAdamW.step before train_step: no reduced gradient pieces")
        pending = None
        for k, bs in enumerate(self.chunks):
            sync = self.syncs[self._chunk_sync[k]]
            inner = self._inner[k]
            if inner is not None:
                for g, gi in zip(inner.param_groups, self._inner_group[k]):
                    g.update({h: self.param_groups[gi][h] for h in HYPER})
                for i in self._members[k]:
                    s = self.segments[i]
                    self._views[i].grad = sync.pieces[s.bucket][s.at:s.at + s.numel]
                inner.step(grad_scale)
            started = (sync.buckets, launch_gather(sync.buckets, bs, [self.segments[i] for i in self._members[k]],
                                                   sync.world, sync.group, sync.rank, sync.param_buffers))
            if pending is not None:
                finish_gather(*pending)
            pending = started
        if pending is not None:
            finish_gather(*pending)
        for sync in self.syncs:
            sync.pieces = [None] * len(sync.buckets)
        self.steps_taken += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the reduced pieces not stepped on (a skipped update); the whole gradients are
        dropped when their bucket is reduced."""
        for sync in self.syncs:
            sync.pieces = [None] * len(sync.buckets)

    # ---- checkpoints: whole per-parameter states, as FusedAdamW's ------------------------------
    def segment_state(self, i: int, field: str) -> Tensor:
        """Segment ``i``'s slice of state ``field`` ("exp_avg", "exp_avg_sq", "master"): flat, this rank's."""
        k, j = self._slot[id(self._views[i])]
        inner = self._inner[k]
        return {"exp_avg": inner.exp_avgs, "exp_avg_sq": inner.exp_avg_sqs, "master": inner.masters}[field][j]

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """What ``checkpoint.load`` reassembles: {"state": {index: whole state}, "param_groups": [...,
        "params": indices]} in ``param_groups``' order; this rank keeps its segments' slices. A
        parameter with no master takes it from its current value; one with no state starts afresh."""
        groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"ShardedAdamW.load_state_dict: expected groups of "
                             f"{[len(g['params']) for g in self.param_groups]} parameters, got "
                             f"{[len(g['params']) for g in groups]}")
        for g, saved in zip(self.param_groups, groups):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
        for inner in self._inner:
            if inner is not None:
                inner.reload_masters()
        order = [p for g in self.param_groups for p in g["params"]]
        seg_of: Dict[int, List[int]] = {}
        for i, s in enumerate(self.segments):
            seg_of.setdefault(id(s.param), []).append(i)
        steps = set()
        for saved, p in zip((i for g in groups for i in g["params"]), order):
            st = state_dict.get("state", {}).get(saved) or {}
            step = st.get("step", 0)
            step = int(step.item() if torch.is_tensor(step) else step)
            steps.add(step)
            for i in seg_of.get(id(p), ()):
                s = self.segments[i]
                k, j = self._slot[id(self._views[i])]
                self._inner[k].steps[j] = step
                for field in ("exp_avg", "exp_avg_sq", "master"):
                    dst = self.segment_state(i, field)
                    if field in st:
                        dst.copy_(st[field].reshape(-1)[s.start:s.stop])
                    elif field != "master":
                        dst.zero_()
        self.steps_taken = max(steps, default=0)

    def state_bytes(self) -> int:
        """Bytes of fp32 state (masters, m, v) this rank holds."""
        return sum(o.state_bytes() for o in self._inner if o is not None)
