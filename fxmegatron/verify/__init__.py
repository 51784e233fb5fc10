"""Translation validation: the parallel program computes what the model computes, or an
error names where it does not.

``verify(model, example_batch, tp=2, pp=2, virtual_stages=2, microbatches=4, dp=2,
sequence_parallel=True)`` captures the model (at microbatch size, as ``parallelize``
does), builds the program of *every* tensor-parallel rank of every data-parallel replica
with the same passes ``parallelize`` runs, cut into pipeline chunks and materialised per
pipeline rank as ``parallelize`` cuts and materialises them (``pipeline.py``), and runs
all of them in this process on simulated ranks (``simulate.py``), on a fresh batch unlike
the example (other ids, the example's masked labels kept, and, when the batch is split, every
label of its last microbatch masked: one that counts no token), split over the replicas and
into microbatches as ``train_step`` splits it. It compares

1. the captured graph with the model run in eager (capture is faithful),
2. the step's loss (microbatch losses weighted by their tokens, averaged over replicas)
   with the model's on the whole batch (``loss_rtol``), and each parameter's gradient,
   accumulated over chunks and microbatches, averaged over replicas, summed over the
   pipeline ranks that share it and reassembled from the tp shards, with the model's
   (``grad_rtol``), on every pipeline rank that holds it,

and, on a difference, reassembles every node's value on the first microbatch from the
tp ranks by its placement and raises ``VerificationError`` naming the first node that
differs from the original graph's, its op, module path, the placement rule that placed
it and its pipeline chunk. Where forward values all agree, it names the microbatch whose
loss differs, or the loss weighting, or the parameter whose gradient differs, the chunks
and pipeline ranks that hold it and the nodes that use it (and, when gradients are
wrong only up to some chunk, that chunk's boundary). The pipeline schedule itself is
checked by ``schedules.simulate``. Models with dropout are compared with dropout off (eval-mode
keys); the masks themselves are keyed by element index and cannot depend on the layout.

With context parallelism (``cp``), every cp × tp rank of a replica runs (``run_grid``: a simulated
tp group per cp rank, a cp group per tp rank, ``cp_attention``'s exchanges between them), gradients
are summed over cp before the average over dp, and node values are joined over cp by their
context-parallel placement (``context.py``) before the comparison.

With ``dp_shard="full"`` every rank of every replica runs at once (``simulate.run_mesh``), each
holding its shard of every parameter; the ``unshard`` nodes gather and reduce-scatter over a
simulated dp × cp group, and the gradients are put together from the shards (``sharded.py``). Under
"optimizer" and "gradients" the graphs are those of "none", and the runtime's own ``GradSync``
reduces their buckets over the simulated group into each rank's pieces, from which the whole
gradients are gathered (``sharded.RuntimeReduction``). Under hybrid sharding (``dp_replicate``)
each replica group shards over its own simulated group and the pieces are summed over a simulated
group of the replicas, as ``mesh.mesh_axes`` cuts dp.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.capture import LossOnly, batch_args, capture
from fxmegatron.compiler import first_microbatch
from fxmegatron.errors import VerificationError
from fxmegatron.ops.dp_gather import regather_in_backward
from fxmegatron.passes.dp_shard import DP_SHARD
from fxmegatron.passes.dropout_rng import dropout_sites
from fxmegatron.passes import batch_term
from fxmegatron.passes.loss_terms import split_loss_problem
from fxmegatron.runtime.id_check import label_inputs
from fxmegatron.runtime.sharded_dp import SHARDED_OPTIMIZER
from fxmegatron.passes.tp_coverage import Coverage
from fxmegatron.placement import R, Replicate, join_shards
from fxmegatron.schedules import ScheduleError, make_schedule
from fxmegatron.schedules.simulate import simulate as simulate_schedule
from fxmegatron.verify.batches import fresh_batch, with_empty_microbatch
from fxmegatron.verify.compare import describe_users, first_divergence, rel_err
from fxmegatron.layout import Layout
from fxmegatron.verify.pipeline import (average_over_replicas, boundary_diagnosis, build_program,
                                        chunk_of_node, holders, join_experts, replica_weights, run_step,
                                        step_microbatches, sum_shared_grads)
from fxmegatron.verify.context import cp_view, sum_over_cp
from fxmegatron.verify.sharded import RuntimeReduction, check_simulated, join_dp_shards
from fxmegatron.verify.simulate import Recorder, run_grid, run_mesh

aten = torch.ops.aten


@dataclass
class VerifyReport:
    layout: str
    loss: float
    loss_ref: float
    max_grad_err: float
    worst_param: str
    nodes: int
    seconds: float
    coverage: Coverage
    chunks: int = 1             # pipeline chunks per tp rank's program (pp·v)
    schedule: str = ""          # the pipeline schedule's check, when there is a pipeline

    def __str__(self):
        split = f" in {self.chunks} chunks" if self.chunks > 1 else ""
        sched = f"; {self.schedule}" if self.schedule else ""
        return (f"verify {self.layout}: exact (loss {self.loss:.6f} vs {self.loss_ref:.6f}; largest gradient "
                f"difference {self.max_grad_err:.1e} at {self.worst_param}; {self.nodes} nodes per rank{split}"
                f"{sched}; {self.seconds:.1f} s)\n{self.coverage.summary()}")


def _without_dropout(gm):
    for n in gm.graph.nodes:
        if n.target is aten.dropout.default:
            n.replace_all_uses_with(n.args[0])
        elif n.target is aten.scaled_dot_product_attention.default:
            if len(n.args) > 4:
                n.args = n.args[:4] + (0.0,) + n.args[5:]
            elif "dropout_p" in n.kwargs:
                n.kwargs = {**n.kwargs, "dropout_p": 0.0}
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# the layout's fields that verify simulates (the rest, such as fuse, compile or fp8, have no
# simulated form: tests/test_layout.py lists them); a layout handed in keeps these alone
VERIFIED = ("dp", "pp", "cp", "tp", "cp_attention", "sequence_parallel", "recompute", "microbatches",
            "virtual_stages", "schedule", "blocks_per_chunk", "seed", "dp_shard", "dp_replicate", "ep")


def verify(model: nn.Module, example_batch, *, tp: int = 2, pp: int = 1, virtual_stages: int = 1,
           microbatches: int = 1, dp: int = 1, sequence_parallel: bool = False, recompute="none",
           schedule: Optional[str] = None, blocks_per_chunk: Optional[Sequence[int]] = None, batch=None,
           seed: int = 0, loss_rtol: float = 1e-5, grad_rtol: float = 1e-4, cp: int = 1,
           cp_attention: str = "ring", layout: Optional[Layout] = None, dp_shard: str = "none",
           dp_replicate: int = 1, ep: int = 1) -> VerifyReport:
    """Check the layout dp × pp (``virtual_stages`` chunks per rank, ``microbatches`` per
    step) × ``cp`` (context parallelism, its attention by ``cp_attention``) × ``tp`` of
    ``model`` on simulated ranks; see the module doc. ``example_batch``
    is the global batch of one step, as for ``parallelize``. ``layout``: a ``Layout`` instead
    of the keywords (its ``VERIFIED`` fields). Returns a report when the
    parallel program is exact, raises ``VerificationError`` otherwise. ``model`` needs
    real weights (a tiny config of the model is enough)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise VerificationError("verify runs the model: build it with real weights (a tiny config of the "
                                "same architecture checks the same rules in seconds)")
    t0 = time.perf_counter()
    if layout is None:
        lay = Layout(tp=tp, pp=pp, virtual_stages=virtual_stages, microbatches=microbatches, dp=dp,
                     sequence_parallel=sequence_parallel, recompute=recompute, schedule=schedule,
                     blocks_per_chunk=blocks_per_chunk, seed=seed, cp=cp, cp_attention=cp_attention,
                     dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep)
    else:
        lay = Layout(**{n: getattr(layout, n) for n in VERIFIED})
    check_simulated(lay)
    tp, pp, dp, seed, cp = lay.tp, lay.pp, lay.dp, lay.seed, lay.cp
    microbatches, virtual_stages, schedule = lay.microbatches, lay.virtual_stages, lay.schedule
    sched_note = ""
    if lay.pipelined():   # the schedule parallelize would run: its order is checked by the simulator
        sched = make_schedule(lay.schedule_name(), pp, virtual_stages, microbatches)
        sim = simulate_schedule(sched)
        sched_note = f"schedule {sched.name} checked (bubble {max(sim.bubble_fraction):.0%})"
    elif schedule not in (None, "gpipe", "1f1b"):
        raise ScheduleError(f"schedule={schedule!r} needs a pipeline (pp > 1 or virtual_stages > 1)")
    layout = layout_name(lay)
    drawn = batch is None
    batch = fresh_batch(example_batch, seed + 1) if drawn else batch
    ref_model = copy.deepcopy(model)
    # traced at microbatch size, as parallelize traces it
    cap = capture(model, first_microbatch(example_batch, microbatches, dp))
    dropout = bool(dropout_sites(cap.gm))
    # what parallelize refuses for a split batch: the diagnosis of a loss difference, and no
    # report of "exact" on a batch where it happens to agree
    # a term that passes.batch_term computes over the dp batch is exact; its replicas run at once (all-reduces)
    over_dp = microbatches * dp > 1 and batch_term.verified_together(cap.gm, lay)
    not_additive = split_loss_problem(cap.gm) if microbatches * dp > 1 and not over_dp else None
    if dropout:
        ref_model.eval()
    if drawn and microbatches * dp > 1:
        batch = with_empty_microbatch(batch, label_inputs(cap.gm), microbatches * dp)
    flat, spec = pytree.tree_flatten(batch_args(batch))
    names = list(cap.input_names) if len(cap.input_names) == len(flat) else [f"input {i}" for i in range(len(flat))]
    micro = step_microbatches(flat, lay, names)
    args, kwargs = batch_args(batch)
    loss_eager = LossOnly(ref_model)(*args, **kwargs)
    loss_eager.backward()
    eager_grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}

    ref_gm = copy.deepcopy(cap.gm)
    if dropout:
        _without_dropout(ref_gm)
    rec = Recorder(ref_gm)
    with torch.no_grad():
        loss_graph = rec.run(*micro[0][0])[0]
        if microbatches * dp == 1:
            loss_model = loss_eager.detach()
        else:
            a, kw = pytree.tree_unflatten(micro[0][0], spec)
            loss_model = LossOnly(ref_model)(*a, **kw)
    if rel_err(loss_graph, loss_model) > loss_rtol:
        raise VerificationError(
            f"capture: the captured graph of {type(model).__name__} computes loss {loss_graph.item():.6f} on a "
            f"fresh batch where the model computes {loss_model.item():.6f}: the graph does not read the batch "
            "as the model does (check the example batch: inputs that alias each other, inputs the model "
            "ignores, Python values that are constants in the graph)")

    programs = [[None] * (cp * tp) for _ in range(dp)]     # by replica, then cp rank · tp + tp rank

    shard = dp // lay.dp_replicate      # the dp ranks of one replica group (hybrid sharding)

    def rank_body(d: int, c: int, rank: int, group_name: str, cp_group: str, dp_group: str = "",
                  replica_group: str = "", ep_group: str = ""):
        prog = build_program(cap, lay, rank, group_name, d, seed, dropout, d == 0 and c == 0 and rank == 0, c,
                             cp_group, dp_group, replica_group, ep_group)
        programs[d][c * tp + rank] = prog
        # the counts of every replica's microbatches: what the all-reduce over dp adds up
        counts = None if prog.counter is None else [[prog.counter(mb) for mb in rep] for rep in micro]
        weights = replica_weights(counts, d, dp, microbatches)
        reduction = RuntimeReduction(prog, lay.dp_shard, dp_group, shard * cp, dp, d % shard * cp + c,
                                     replica_group) if runtime else None
        if reduction is not None:
            reduction.start(microbatches)
        with regather_in_backward() if sharded else contextlib.nullcontext():    # as train_step runs it
            out = run_step(prog, micro[d], weights, record=d == 0)
        if reduction is not None:       # the buckets' reduced gradients, in place of this rank's own
            out["grads"] = reduction.finish()
        out["weights"] = weights
        return out

    sharded = lay.dp_shard == "full" and dp * cp > 1
    runtime = lay.dp_shard in SHARDED_OPTIMIZER and dp * cp > 1
    if sharded or runtime or lay.ep > 1 or over_dp:     # every rank at once: the collectives span the replicas
        flat = run_mesh(dp, cp, tp, lambda d, c, t, g: rank_body(d, c, t, g["tp"], g["cp"], g["dp_cp"],
                                                                 g["dp_replicate"], g["ep"]), lay.dp_replicate, lay.ep)
        results = [flat[d * cp * tp:(d + 1) * cp * tp] for d in range(dp)]
    else:           # the replicas one after the other, each with its own simulated tp and cp groups
        results = [run_grid(cp, tp, functools.partial(rank_body, d)) for d in range(dp)]
    prog0 = programs[0][0]
    plan = prog0.plan

    replica_loss = [r[0]["loss"] for r in results]
    loss = sum(replica_loss[1:], replica_loss[0]) / dp
    bad_loss = rel_err(loss, loss_eager.detach()) > loss_rtol or any(
        rel_err(x["loss"], r[0]["loss"]) > loss_rtol for r in results for x in r)
    # per tp rank, per pipeline rank: the gradients after GradSync and the shared-weight sum
    final = []
    for t in range(tp):
        if runtime:         # reduced over dp × cp already, the same on every rank of the group
            g = [dict(x) for x in results[0][t]["grads"]]
        elif sharded:
            # the first replica group's shards (under hybrid sharding each group holds them all)
            g = join_dp_shards([results[d][c * tp + t]["grads"] for d in range(shard) for c in range(cp)],
                               programs[0][t].local.meta.get(DP_SHARD, {}))
        else:
            per_replica = [sum_over_cp([results[d][c * tp + t]["grads"] for c in range(cp)]) for d in range(dp)]
            g = average_over_replicas(join_experts(per_replica, programs[0][t].local, lay.ep), programs[0][t].params)
        if pp > 1:
            sum_shared_grads(g, programs[0][t].shared)
        final.append(g)
    grad_errs, bad_grads = {}, []
    floor = 0.01 * max((g.abs().max().item() for g in eager_grads.values()), default=0.0)
    for name, ref in eager_grads.items():
        canon = cap.aliases.get(name, name)
        plc = plan.param_plc.get(canon, R)
        held = [r for r in range(pp) if canon in prog0.params[r]] or [0]
        grad_errs[name] = 0.0
        for r in held:
            at = f" on pp rank {r}" if pp > 1 else ""
            shards = [final[t][r].get(canon) for t in range(tp)]
            if any(s is None for s in shards):
                grad_errs[name] = float("inf")
                bad_grads.append((name, f"no gradient reached it on some rank{at}"))
                break
            if isinstance(plc, Replicate):
                spread = max(rel_err(s, shards[0], floor) for s in shards)
                if spread > grad_rtol:
                    bad_grads.append((name, f"replicated, but its gradient differs between tp ranks{at} by "
                                            f"{spread:.2e}"))
            whole = shards[0] if isinstance(plc, Replicate) else join_shards(shards, plc)
            err = rel_err(whole, ref, floor)
            grad_errs[name] = max(grad_errs[name], err)
            if err > grad_rtol:
                bad_grads.append((name, f"gradient{at} differs by {err:.2e} (relative; tolerance {grad_rtol:g})"))
                break
    if bad_loss or bad_grads:
        head = (f"verify {layout} of {type(model).__name__}: the parallel program differs from the model "
                f"(loss {loss.item():.6f}, the model's {loss_eager.item():.6f})")
        div = first_divergence(ref_gm.graph, rec.values, prog0.local.graph, [r["values"] for r in results[0]],
                               max(loss_rtol, 1e-4), cp_view(prog0.local, tp))
        if div is not None:
            c = chunk_of_node(prog0).get(div.node)
            where = [f"chunk {c} on pp rank {c % pp}"] if c is not None else []
            if microbatches * dp > 1:
                where.append("microbatch 0 of dp replica 0")
            where = f" ({'; '.join(where)})" if where else ""
            raise VerificationError(f"{head}; first divergent {div}{where}")
        if bad_loss:
            raise VerificationError(f"{head}; {_loss_diagnosis(ref_gm, micro, results, loss_rtol, not_additive)}")
        name, why = bad_grads[0]
        if not_additive:    # the loss may agree to its tolerance where the term's gradients do not
            raise VerificationError(f"{head}; every forward value agrees, but parameter {name}: {why}, and the loss "
                                    f"is not additive over microbatches and dp replicas: {not_additive}")
        canon = cap.aliases.get(name, name)
        where = holders(prog0, canon)
        raise VerificationError(f"{head}; every forward value agrees, but parameter {name} "
                                f"(placed {plan.param_plc.get(canon, R)}{', ' + where if where else ''}): {why}; "
                                f"it is used by {describe_users(prog0.local.graph, canon)}"
                                f"{boundary_diagnosis(prog0, [cap.aliases.get(n, n) for n, _ in bad_grads])}")
    if not_additive:
        raise VerificationError(f"verify {layout} of {type(model).__name__}: the step's loss agrees with the model's on "
                                f"this batch, but not on every batch, and parallelize refuses this layout: "
                                f"{not_additive}")
    worst = max(grad_errs, key=grad_errs.get) if grad_errs else ""
    nodes = sum(1 for _ in prog0.local.graph.nodes)
    return VerifyReport(layout, loss.item(), loss_eager.item(), grad_errs.get(worst, 0.0), worst, nodes,
                        time.perf_counter() - t0, prog0.coverage, len(prog0.modules), sched_note)


def layout_name(lay: Layout) -> str:
    parts = [f"tp={lay.tp}"]
    parts += [f"{k}={v}" for k, v in (("pp", lay.pp), ("v", lay.virtual_stages), ("m", lay.microbatches),
                                      ("dp", lay.dp), ("ep", lay.ep), ("cp", lay.cp)) if v > 1]
    if lay.cp > 1 and lay.cp_attention != "ring":
        parts.append(f"cp_attention={lay.cp_attention}")
    if lay.sequence_parallel:
        parts.append("sp")
    if lay.recompute != "none":
        parts.append(f"recompute={lay.recompute}")
    if lay.dp_shard != "none":
        parts.append(f"dp_shard={lay.dp_shard}")
    if lay.dp_replicate > 1:
        parts.append(f"dp_replicate={lay.dp_replicate}")
    return " ".join(parts)


def _loss_diagnosis(ref_gm, micro, results, rtol: float, not_additive: Optional[str] = None) -> str:
    """Which microbatch's loss differs from the model graph's on it, or, when none does, the term
    of the loss that is not additive over microbatches (``not_additive``), or else that the
    weighting of the microbatch losses into the step's loss is what is wrong."""
    with torch.no_grad():
        for d, rep in enumerate(micro):
            for i, mb in enumerate(rep):
                want = ref_gm(*mb)[0]
                got = results[d][0]["losses"][i]
                # a microbatch with no counted label: NaN (0/0) in both, as the model's mean over none
                both_nan = bool(torch.isnan(got).all() and torch.isnan(want).all())
                if rel_err(got, want) > rtol and not both_nan:
                    return (f"the loss of microbatch {i} of dp replica {d} is {got.item():.6f} where the captured "
                            f"graph computes {want.item():.6f} on it")
    if not_additive:
        return ("every microbatch's loss agrees with the model's on that microbatch, but the loss is not additive "
                f"over microbatches and dp replicas: {not_additive}")
    weights = [[round(w, 4) for w in r[0]["weights"]] for r in results]
    return ("every microbatch's loss agrees with the model's on that microbatch, but their weighted sum over the "
            f"step (weights by dp replica {weights}, then the mean over replicas) is not the batch's loss: the "
            "microbatch loss weighting is wrong")


__all__ = ["verify", "VerifyReport", "Layout", "layout_name", "fresh_batch"]
