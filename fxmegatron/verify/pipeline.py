"""A layout's pipeline and data-parallel parts, run on simulated tensor-parallel ranks.

For each data-parallel replica and tensor-parallel rank, the rank's program is built
as ``parallelize`` builds it, by ``lower.rank.build_rank``: the compiler's pass list (the
tp rewrite, dropout keyed by the replica's rank, meta shards, recompute), then, with a
pipeline, the cut into pp·v chunks, the boundary shapes and the stage of *every* pipeline
rank (the axis names bound to the simulated group), so that a weight held by two pipeline
ranks (a tied embedding and LM head) is two parameters, as on a cluster.

One thread per tensor-parallel rank then runs every chunk of its program, in chunk
order, microbatch by microbatch. What crosses a boundary is what a receive gives the
next rank: a fresh tensor of the announced shape and dtype, a leaf that asks for a
gradient only where the split says one flows back, so a boundary the split gets wrong
fails here as it would between two processes. The order in which a schedule
interleaves microbatches and chunks is not run here: ``schedules.simulate`` checks
it (``verify`` calls it), and accumulation order changes only rounding.

After the step, what the runtime's collectives would do is done on the results:
gradients averaged over replicas (``GradSync``: a sum, divided by dp), then the
gradients of weights held by several pipeline ranks summed over them
(``ParallelModel``'s shared-gradient sum); the step's loss is the replicas' mean.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from fxmegatron.capture import Captured
from fxmegatron.errors import VerificationError
from fxmegatron.layout import Layout
from fxmegatron.lower.rank import build_rank
from fxmegatron.lower.rank_passes import EXPERT_CUT
from fxmegatron.lower.stages import token_counter
from fxmegatron.passes.pipeline_split import Chunk
from fxmegatron.passes.tensor_parallel import TPPlan
from fxmegatron.passes.tp_coverage import Coverage
from fxmegatron.placement import Shard, join_shards
from fxmegatron.runtime.microbatches import loss_weights, split_batch
from fxmegatron.schedules.runtime import TensorSpec, add_weighted
from fxmegatron.verify.simulate import Recorder


@dataclass
class SimulatedRank:
    """One (dp replica, tp rank)'s program: its chunks (one, the whole graph, without a
    pipeline) and, per pipeline rank, the parameters that rank holds."""

    local: fx.GraphModule                       # the unsplit graph: placements in node.meta
    plan: TPPlan
    modules: Dict[int, fx.GraphModule]          # chunk index -> module (of its pipeline rank's stage)
    batch_inputs: Dict[int, List[int]]
    specs: Dict[int, List[TensorSpec]]
    params: List[Dict[str, nn.Parameter]]       # by pipeline rank
    shared: List[str] = field(default_factory=list)   # weights held by several pipeline ranks
    chunks: List[Chunk] = field(default_factory=list)
    counter: Optional[Callable] = None          # flat microbatch -> tokens its loss averages over
    coverage: Optional[Coverage] = None


BUILD_LOCK = threading.Lock()     # build_program's docstring says why


def build_program(cap: Captured, lay: Layout, tp_rank: int, group_name: str, dp_rank: int, seed: int,
                  dropout: bool, with_coverage: bool, cp_rank: int = 0, cp_group: str = "",
                  dp_group: str = "", replica_group: str = "", ep_group: str = "") -> SimulatedRank:
    """The program of tp rank ``tp_rank`` of replica ``dp_rank``, built by the compiler's own
    list of passes (``lower.rank.build_rank``, its tp collectives on ``group_name``), then
    materialised on the CPU as each pipeline rank would (every pipeline rank's stage).

    Simulated ranks are threads, and every rank's graph computes on the FakeTensors of the
    one capture, whose ``FakeTensorMode`` is not thread-safe: it flags "inside a kernel" on
    the mode, not per thread, so a rank building while another's fake kernel runs failed
    (``fake_mode.in_kernel_invocation must be False``) about once in a dozen runs. Builds
    therefore take turns (``BUILD_LOCK``); the ranks' programs still run side by side."""
    with BUILD_LOCK:
        return _build_program(cap, lay, tp_rank, group_name, dp_rank, seed, dropout, with_coverage, cp_rank, cp_group,
                              dp_group, replica_group, ep_group)


def _build_program(cap: Captured, lay: Layout, tp_rank: int, group_name: str, dp_rank: int, seed: int,
                   dropout: bool, with_coverage: bool, cp_rank: int, cp_group: str, dp_group: str,
                   replica_group: str, ep_group: str = "") -> SimulatedRank:
    gm = copy.deepcopy(cap.gm)
    if lay.seed != seed:
        lay = dataclasses.replace(lay, seed=seed)
    # every pipeline rank's stage, on the CPU, from the rank's own copy of the capture's graph
    built = build_rank(cap, lay, {"tp": tp_rank, "dp": dp_rank, "cp": cp_rank}, "cpu",
                       {"tp": group_name, "cp": cp_group, "dp_cp": dp_group, "dp_replicate": replica_group,
                        "ep": ep_group},
                       stages=range(lay.pp), graph=gm)
    local, plan = built.local, built.plan
    if built.chunks is None:
        whole = built.whole
        whole.meta.update(built.local.meta)       # the plans, for the comparison
        if dropout:
            whole.eval()
        n_inputs = sum(1 for n in whole.graph.nodes if n.op == "placeholder")
        prog = SimulatedRank(whole, plan, {0: whole}, {0: list(range(n_inputs))}, {}, [dict(whole.named_parameters())])
    else:
        chunks, stages = built.chunks, [built.stages[r] for r in range(lay.pp)]
        modules = {k: mod for st in stages for k, mod in st.modules.items()}
        if dropout:
            for mod in modules.values():
                mod.eval()
        prog = SimulatedRank(local, plan, modules, {c.index: c.batch_inputs for c in chunks}, built.specs,
                             [st.params for st in stages], sorted(stages[0].shared), chunks)
    if lay.microbatches > 1 or lay.dp > 1:     # as parallelize: token weighting only where a step splits the batch
        prog.counter = token_counter(local, "cpu")
    prog.coverage = built.coverage if with_coverage else None
    return prog


def step_microbatches(flat: Sequence, lay: Layout, names: Sequence[str]) -> List[List[List]]:
    """[replica][microbatch] -> flat inputs: the global batch split as ``train_step`` splits it."""
    shares = split_batch(flat, lay.dp, names, f"dp={lay.dp}") if lay.dp > 1 else [list(flat)]
    return [split_batch(share, lay.microbatches, names) for share in shares]


def replica_weights(counts: Optional[List[List[int]]], dp_rank: int, dp: int, m: int) -> List[float]:
    """Replica ``dp_rank``'s microbatch weights, by ``runtime.microbatches.loss_weights`` as
    ``ParallelModel`` computes them; N is what its all-reduce over dp sums."""
    if counts is None:
        return loss_weights(None, 0, dp, m)
    return loss_weights(counts[dp_rank], float(sum(sum(c) for c in counts)), dp, m)


def _received(t, spec: TensorSpec, c: int, name: str):
    """What a receive of ``t`` gives the next pipeline rank: a new leaf of the announced shape."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
        got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise VerificationError(f"chunk {c} sends {name} as {got}, but boundary_specs announced "
                                f"{list(spec.shape)} {spec.dtype}: the receiving rank's buffer would not match")
    buf = torch.empty(spec.shape, dtype=spec.dtype)
    buf.copy_(t.detach())
    return buf.requires_grad_(spec.grad)


def _boundary_names(prog: SimulatedRank, c: int) -> List[str]:
    return prog.chunks[c].boundary_out if prog.chunks else []


def run_step(prog: SimulatedRank, micro: List[List], weights: Sequence[float], record: bool) -> Dict[str, object]:
    """Forward and backward of every microbatch through every chunk, the loss weighted as the
    runtime weights it; returns the step's loss, each microbatch's, every node value of the
    first microbatch (``record``) and the gradients by pipeline rank."""
    n = len(prog.modules)
    total, losses, values = None, [], {}
    for i, (mb, w) in enumerate(zip(micro, weights)):
        ins, outs, carried = [], [], []
        for c in range(n):
            try:
                if c and len(carried) != len(prog.specs[c - 1]):
                    raise VerificationError(f"chunk {c - 1} sends {len(carried)} values, but boundary_specs "
                                            f"announced {len(prog.specs[c - 1])}")
                boundary = [_received(t, s, c - 1, nm) for t, s, nm in
                            zip(carried, prog.specs.get(c - 1, []), _boundary_names(prog, c - 1))] if c else []
                args = boundary + [mb[k] for k in prog.batch_inputs[c]]
                if record and i == 0:
                    rec = Recorder(prog.modules[c])
                    out = rec.run(*args)
                    values.update(rec.values)
                else:
                    out = prog.modules[c](*args)
            except (VerificationError, threading.BrokenBarrierError):
                raise
            except Exception as exc:
                where = f"chunk {c} of {n} (units {prog.chunks[c].units[0]} .. {prog.chunks[c].units[-1]})" \
                    if prog.chunks else "the rank graph"
                raise VerificationError(f"{where} fails on microbatch {i}: {type(exc).__name__}: {exc}") from exc
            ins.append(boundary)
            outs.append(out)
            carried = list(out) if c < n - 1 else []
        loss = out[0] if isinstance(out, (tuple, list)) else out
        losses.append(loss.detach().clone())
        total = add_weighted(total, loss, w)
        torch.autograd.backward(loss * w)
        for c in reversed(range(n - 1)):
            # what the next rank sends back: its boundary leaves' gradients (zeros where none came)
            grads = [(b.grad if b.grad is not None else torch.zeros_like(b)) if s.grad else None
                     for b, s in zip(ins[c + 1], prog.specs[c])]
            pairs = [(t, g) for t, g, s in zip(outs[c], grads, prog.specs[c]) if s.grad and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    grads = [{k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
             for params in prog.params]
    return {"loss": total.detach().clone(), "losses": losses, "values": values, "grads": grads}


def join_experts(per_replica: List[List[Dict[str, torch.Tensor]]], local: fx.GraphModule,
                 ep: int) -> List[List[Dict[str, torch.Tensor]]]:
    """Expert parallelism: each replica's expert gradients (its E/ep experts, summed over its ep
    group's tokens) made whole over its ep group and divided by ep, so that the average over
    replicas is GradSync's: the sum over the groups / dp. ``local``: the rank's graph (its expert
    parameters and their experts dims in its meta)."""
    if ep == 1:
        return per_replica
    experts = local.meta[EXPERT_CUT][0]
    out = [[dict(g) for g in rep] for rep in per_replica]
    for first in range(0, len(per_replica), ep):
        for r in range(len(per_replica[first])):
            for name, dim in experts.items():
                pieces = [per_replica[first + e][r].get(name) for e in range(ep)]
                if any(g is None for g in pieces):
                    continue
                whole = join_shards(pieces, Shard(dim)) / ep
                for e in range(ep):
                    out[first + e][r][name] = whole
    return out


def average_over_replicas(per_replica: List[List[Dict[str, torch.Tensor]]],
                          params: List[Dict[str, nn.Parameter]]) -> List[Dict[str, torch.Tensor]]:
    """GradSync's result, by pipeline rank: every replica's gradient summed, divided by dp (a
    replica without a gradient contributes zeros, as in its bucket)."""
    dp = len(per_replica)
    out = []
    for r, held in enumerate(params):
        avg = {}
        for name, p in held.items():
            gs = [rep[r].get(name) for rep in per_replica]
            if all(g is None for g in gs):
                continue
            avg[name] = sum(g if g is not None else torch.zeros_like(p, device="cpu") for g in gs) / dp
        out.append(avg)
    return out


def sum_shared_grads(grads: List[Dict[str, torch.Tensor]], shared: Sequence[str]) -> None:
    """The shared-gradient sum over the pipeline group, in place: every holder of a weight
    gets the sum of all holders' gradients (the other ranks add zeros)."""
    for name in shared:
        held = [g[name] for g in grads if name in g]
        if not held:
            continue
        whole = sum(held[1:], held[0].clone())
        for g in grads:
            if name in g:
                g[name] = whole.clone()


def holders(prog: SimulatedRank, name: str) -> str:
    """Where weight ``name`` lives: its chunks and their pipeline ranks."""
    if not prog.chunks:
        return ""
    p = len(prog.params)
    cs = [c.index for c in prog.chunks if name in c.params]
    ranks = sorted({c % p for c in cs})
    shared = f", shared by pp ranks {ranks}: its gradient is their sum" if len(ranks) > 1 else ""
    return f"in chunk{'s' if len(cs) > 1 else ''} {', '.join(map(str, cs))} (pp rank " \
           f"{', '.join(str(c % p) for c in cs)}){shared}"


def chunk_of_node(prog: SimulatedRank) -> Dict[str, int]:
    return {n.name: c.index for c in prog.chunks for n in c.gm.graph.nodes if n.op not in ("placeholder", "output")}


def boundary_diagnosis(prog: SimulatedRank, bad: Sequence[str]) -> str:
    """With every forward value right, gradients wrong in chunks 0..k and right after k point at
    chunk k's backward or at the gradients chunk k+1 sends back: say so."""
    if not prog.chunks or not bad:
        return ""
    bad_chunks = {c.index for c in prog.chunks for name in bad if name in c.params}
    k = max(bad_chunks)
    later = {name for c in prog.chunks[k + 1:] for name in c.params}
    if k == len(prog.chunks) - 1 or any(name in later for name in bad):
        return ""
    c = prog.chunks[k]
    flows = ", ".join(f"{nm} ({'gradient' if s.grad else 'no gradient'})"
                      for nm, s in zip(c.boundary_out, prog.specs[k]))
    return (f"; gradients differ in chunks up to {k} and agree after it: the backward of chunk {k} or "
            f"the gradients chunk {k + 1} sends back to it are wrong (boundary {k} -> {k + 1} carries {flows})")

