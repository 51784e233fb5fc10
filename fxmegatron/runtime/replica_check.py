"""Ranks that hold copies of one weight still hold the same bits, during training.

``parallelize`` refuses ranks built with different weights (``data_parallel.check_same_weights``).
Copies that start equal stay equal only if every rank applies the same update: the data-parallel
average and f's all-reduce give each rank the same sum, and ``passes.tensor_parallel.same_grads``
averages the gradients that each tp rank computes alone. A rule that misses a case parts them
without an error (two H200 at tp2 parted a Mixture's routers from the first step before that
pass existed). ``check_replicas`` compares them: a fingerprint per parameter, computed on the
device where it lies, is all that moves; the trainer runs it before each checkpoint is written
and every ``run.check_replicas_every`` steps.
"""
from __future__ import annotations

import torch

from fxmegatron.lower.materialize import DIGESTS
from fxmegatron.placement import R
from fxmegatron.runtime.data_parallel import check_same_weights

CHUNK = 1 << 24         # elements a fingerprint reads at a time (an int64 copy of them)
MODULUS = 65521         # the largest prime below 2**16: the position weights of the second sum


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> str:
    """Two integer sums over ``t``'s bits (as integers of its element size): their plain sum and
    their sum weighted by (position mod 65521) + 1, with its dtype and shape. Integer sums are
    exact and independent of the order of addition, so equal tensors give equal fingerprints on
    any device; a tensor that differs in one element always differs in the weighted sum (the
    difference of two 16- or 32-bit patterns times a weight below 2**16 is not 0 mod 2**64)."""
    x = t.detach().reshape(-1)
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    bits = x.view(view)
    plain = torch.zeros((), dtype=torch.int64, device=x.device)
    weighted = torch.zeros((), dtype=torch.int64, device=x.device)
    for at in range(0, bits.numel(), CHUNK):
        piece = bits[at:at + CHUNK].to(torch.int64)
        w = torch.arange(at, at + piece.numel(), device=x.device, dtype=torch.int64).remainder_(MODULUS).add_(1)
        plain += piece.sum()
        weighted += (piece * w).sum()
    return f"{t.dtype}{tuple(t.shape)}:{int(plain)}:{int(weighted)}"


def check_replicas(pm, after: str = "") -> None:
    """Raise ``errors.ReplicaError`` on every rank, naming the parameter and the ranks, when the
    copies of a parameter differ: the tp ranks of one replicated over tp, the data-parallel
    replicas (and cp ranks) of one they hold whole, the pipeline ranks of a tied weight.
    Parameters the dp ranks hold different pieces of (``dp_shard="full"``'s shards, expert
    parallelism's experts) are compared over tp and pp only. Collective over every rank of
    ``pm``'s job. ``after``: where training stands, for the message ("after step 12")."""
    pipe = pm.program.pipeline
    modules = pipe.stage.modules.values() if pipe is not None else [pm.graph_module]
    apart = {n for m in modules for n in getattr(m, "meta", {}).get(DIGESTS, {})} | set(pm.program.experts)
    named = list(pm.named_parameters())
    check_same_weights(named, pm.program.axes, lambda n: pm.placement(n) == R,
                       pipe.stage.shared if pipe is not None else (),
                       known={n: fingerprint(p) for n, p in named}, apart=apart, after=after)
