"""Context parallelism (CP): the whole model runs on this rank's part of the sequence.

Rank r of ``cp`` holds chunks r and 2·cp−1−r of the sequence cut in 2·cp (each rank
then has as much causal attention work as any other). ``plan_context_parallel``
(propagate.py, rules.py) gives every node a placement on the cp axis (``layout``): this
rank's chunks (``Shard(d, seq_inner=i)``), whole with its sequence known
(``Replicate(seq=(d, i))``), whole (``R``), or a partial sum over cp (``P``). The rewrite
(rewrite.py) then takes whole values apart where they meet chunks (``cp_take``), turns
attention into ``cp_attention`` (keys and values from every rank, by a ring of P2P or
an all-gather), a mean loss into this rank's sum over the count of every rank, makes
partial sums whole (``cp_sum``) and shrinks the sequence in view sizes. It runs on the
captured graph before tensor parallelism, which then sees a shorter sequence.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.fx as fx

from fxmegatron.errors import ShardingError
from fxmegatron.passes.context_parallel.propagate import CPPlan, State
from fxmegatron.passes.context_parallel.rewrite import apply_context_parallel_plan

VARIANTS = ("ring", "allgather")


def sequence_length(gm: fx.GraphModule) -> int:
    """The traced sequence length: dim 1 of the first batch input with two dims or more."""
    for n in gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.ndim >= 2:
            return int(v.shape[1])
    raise ShardingError("context parallelism needs a batch input shaped [batch, sequence, ...]; the graph has none")


def plan_context_parallel(gm: fx.GraphModule, cp: int, param_names: Iterable[str], experts: Sequence = ()) -> CPPlan:
    seq = sequence_length(gm)
    if seq % (2 * cp):
        raise ShardingError(f"sequence length {seq} is not divisible by 2·cp = {2 * cp} (load-balanced context "
                            "parallelism: each rank holds two chunks)")
    return State(gm, cp, seq, set(param_names), experts).run()


def apply_context_parallel(gm: fx.GraphModule, cp: int, rank: int, group_name: str, param_names: Iterable[str],
                           variant: str = "ring", experts: Sequence = ()) -> fx.GraphModule:
    """``gm`` rewritten in place for cp rank ``rank`` (meta values stay the whole model's
    until the caller propagates shapes); the plan lands in ``gm.meta["fxmegatron/cp_plan"]``.
    ``experts``: the model's mixture-of-experts blocks (``expert_parallel.find_experts``), each
    run on this rank's tokens (``experts``)."""
    if variant not in VARIANTS:
        raise ShardingError(f"cp_attention={variant!r}: expected one of {VARIANTS}")
    plan = plan_context_parallel(gm, cp, param_names, experts)
    apply_context_parallel_plan(gm, plan, rank, group_name, variant)
    gm.meta["fxmegatron/cp_plan"] = plan
    return gm
