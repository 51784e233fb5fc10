"""Rows per expert, as expert parallelism's forward computes them, kept for the trainer's log.

``record_expert_counts(counts, block)`` is an op the expert-parallel rewrite puts after each
mixture-of-experts block's histogram of rows per local expert (``passes/expert_parallel/rewrite.py``):
each call adds ``counts`` to this process's running sum for ``block`` (the module's path), on
its device, without a sync. ``take_expert_counts()`` returns the sums since the last take and
starts new ones; what is never taken stays one tensor per block (a sum, not a list).

It is a ``torch.library`` custom op with a no-op fake: fake-tensor propagation (the passes'
shape checks), export and compile see an op with no output, and nothing is recorded. Its
effect is registered (``torch.library._register_effectful_op``), so neither fx's
``eliminate_dead_code`` nor torch.compile drops it although nothing reads it. A recomputed
forward records again: every microbatch of a block then twice, which scales its counts, not
their ratios.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

_SUMS: Dict[str, Tensor] = {}


@torch.library.custom_op("fxmegatron::record_expert_counts", mutates_args=())
def record_expert_counts(counts: Tensor, block: str) -> None:
    c = counts.detach().to(torch.int64)
    prev = _SUMS.get(block)
    _SUMS[block] = c if prev is None else prev + c


@record_expert_counts.register_fake
def _(counts, block):
    return None


RECORD = torch.ops.fxmegatron.record_expert_counts.default     # the graph node's target


def _register_effect(op) -> None:
    """An effect of its own for ``op``: kept by dead-code elimination and by torch.compile, and
    ordered there. ``torch.library._register_effectful_op`` where torch has it (2.13 does); else the same in
    ``torch._higher_order_ops.effects``; failing both, fx's side-effect set (fx keeps it)."""
    reg = getattr(torch.library, "_register_effectful_op", None)
    if reg is not None:
        reg(op, torch.library.EffectType.ORDERED)
        return
    try:
        from torch._higher_order_ops import effects
        effects._register_effectful_op(op, effects._EffectType.ORDERED)
    except (ImportError, AttributeError, TypeError):
        torch.fx.node.has_side_effect(op)


_register_effect(RECORD)


def take_expert_counts() -> Dict[str, Tensor]:
    """{block: int64 rows per local expert, summed over the forwards since the last take}, and
    the sums start again from nothing."""
    out = dict(_SUMS)
    _SUMS.clear()
    return out
