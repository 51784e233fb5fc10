"""Sequence parallelism (Korthikanti et al. 2022) inside placement propagation.

With ``sequence_parallel=True`` a partial sum that flows into norms, dropout and
residual adds is reduce-scattered along the sequence (the second-to-last dim of
[..., s, h] activations) instead of all-reduced, and those ops run on sequence
shards. A sequence shard carries the origin marker ``SEQ``; one that reaches
anything that cannot run on it (a column-parallel matmul, a view merging the
sequence) is all-gathered there. Sequence shards are never demoted, only gathered.
Each helper reads a rule's ``View`` and adds to its outcome.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import norm, val
from fxmegatron.passes.tensor_parallel.plan import GATHER, GATHER_INTO_COLUMN, SCATTER

if TYPE_CHECKING:
    from fxmegatron.passes.tensor_parallel.view import View

SEQ = "<sequence>"   # origin marker of sequence shards: on conflict they are gathered


def gather(view: "View", a: fx.Node, consumer: fx.Node, into_column: bool = False) -> None:
    """All-gather a sequence shard for ``consumer``. Into a column-parallel matmul the
    gather's backward reduce-scatters (it is Megatron's f as well); anywhere else the
    gathered value starts an ordinary replicated region whose gradient is whole, so the
    backward only keeps this rank's slice."""
    dim = norm(view.base(a).dim, val(a).ndim)
    view.add(GATHER_INTO_COLUMN if into_column else GATHER, a, consumer, dim)


def reduce_partial(view: "View", a: fx.Node, consumer: fx.Node) -> None:
    """Make a partial sum whole for an op that can run on sequence shards:
    reduce-scatter along the sequence under sequence parallelism, else all-reduce (g); a
    partial average always all-reduced."""
    v = val(a)
    # a partial average (a mean over heads) is made whole where it is: its readers hold every token
    if view.sp and v.ndim >= 3 and v.shape[-2] % view.tp == 0 and view.get(a).op == "sum":
        view.add(SCATTER, a, consumer, v.ndim - 2)
        view.bias_after_reduction_of(a)
    else:
        view.replicate(a, consumer)


def gather_instead_of_demote(view: "View", origins, node: fx.Node) -> set:
    """The sequence branch of ``View.demote``: a sequence shard that cannot go on is
    gathered where it enters ``node`` (the attempt stops); returns the matmul origins left."""
    if SEQ not in origins:
        return set(origins)
    new = {(a, node) for a in node.all_input_nodes if SEQ in view.orig(a)} - view.force_gather
    if new:
        view.stop(force_gather=new)
    return set(origins) - {SEQ}


def forced_gathers(view: "View", node: fx.Node) -> None:
    """Gathers an earlier attempt asked for at the inputs of ``node``."""
    for a in node.all_input_nodes:
        if (a, node) in view.force_gather:
            gather(view, a, node)
