"""Sequence parallelism (Korthikanti et al. 2022) inside placement propagation.

With ``sequence_parallel=True`` a partial sum that flows into norms, dropout and
residual adds is reduce-scattered along the sequence (the second-to-last dim of
[..., s, h] activations) instead of all-reduced, and those ops run on sequence
shards. A sequence shard carries the origin marker ``SEQ``; one that reaches
anything that cannot run on it (a column-parallel matmul, a view merging the
sequence) is all-gathered there. Sequence shards are never demoted, only gathered.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import norm, val
from fxmegatron.passes.tensor_parallel.plan import GATHER, GATHER_INTO_COLUMN, SCATTER, SPLIT, Restart

if TYPE_CHECKING:
    from fxmegatron.passes.tensor_parallel.propagate import State

SEQ = "<sequence>"   # origin marker of sequence shards: on conflict they are gathered


def gather(state: "State", a: fx.Node, consumer: fx.Node, into_column: bool = False) -> None:
    """All-gather a sequence shard for ``consumer``. Into a column-parallel matmul the
    gather's backward reduce-scatters (it is Megatron's f as well); anywhere else the
    gathered value starts an ordinary replicated region whose gradient is whole, so the
    backward only keeps this rank's slice."""
    dim = norm(state.base(a).dim, val(a).ndim)
    state.plan.add(GATHER_INTO_COLUMN if into_column else GATHER, a, consumer, dim)


def reduce_partial(state: "State", a: fx.Node, consumer: fx.Node) -> None:
    """Make a partial sum whole for an op that can run on sequence shards:
    reduce-scatter along the sequence under sequence parallelism, else all-reduce (g)."""
    v = val(a)
    if state.sp and v.ndim >= 3 and v.shape[-2] % state.tp == 0:
        state.plan.add(SCATTER, a, consumer, v.ndim - 2)
        if a in state.pending_bias:
            state.plan.bias_after[a] = state.pending_bias[a]
    else:
        state.replicate(a, consumer)


def gather_instead_of_demote(state: "State", origins, node: fx.Node) -> set:
    """The sequence branch of ``State.demote``: a sequence shard that cannot go on is
    gathered where it enters ``node`` (restart); returns the matmul origins left."""
    if SEQ not in origins:
        return set(origins)
    seq_inputs = [a for a in node.all_input_nodes if SEQ in state.orig(a)]
    new = {(a, node) for a in seq_inputs} - state.force_gather
    if new:
        state.force_gather |= new
        raise Restart
    return set(origins) - {SEQ}


def forced_gathers(state: "State", node: fx.Node) -> None:
    """Gathers an earlier attempt asked for at the inputs of ``node``."""
    for a in node.all_input_nodes:
        if (a, node) in state.force_gather:
            gather(state, a, node)


def seq_edge_dim(state: "State", a: fx.Node, consumer: fx.Node):
    """The dim of a sequence shard that ``consumer`` sees where ``a`` enters it through a
    reduce-scatter or a split; None when it enters otherwise."""
    for change in (SCATTER, SPLIT):
        if state.plan.sees(change, a, consumer):
            return state.plan.dim_of(change, a)
    return None
