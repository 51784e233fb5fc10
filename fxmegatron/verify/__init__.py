"""Translation validation: the parallel program computes what the model computes, or an
error names where it does not.

``verify(model, example_batch, tp=2, sequence_parallel=True)`` captures the model,
builds the program of *every* tensor-parallel rank with the same passes
``parallelize`` runs, and runs all of them in this process on simulated ranks
(``simulate.py``), on a fresh batch unlike the example (other ids, the example's
masked labels kept). It compares

1. the captured graph with the model run in eager (capture is faithful),
2. the ranks' loss with the model's (``loss_rtol``) and each parameter's gradient,
   reassembled from the ranks' shards, with the model's (``grad_rtol``),

and, on a difference, reassembles every node's value from the ranks by its
placement and raises ``VerificationError`` naming the first node that differs from
the original graph's, its op, module path and the placement rule that placed it.
Where forward values all agree and a gradient differs, it names the parameter and
the nodes that use it. Models with dropout are compared with dropout off (eval-mode
keys); the masks themselves are keyed by element index and cannot depend on tp.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.capture import LossOnly, batch_args, capture
from fxmegatron.compiler import assemble_local, transform_rank
from fxmegatron.errors import VerificationError
from fxmegatron.passes.dropout_rng import dropout_sites
from fxmegatron.passes.recompute import apply_recompute
from fxmegatron.passes.tp_coverage import Coverage, coverage
from fxmegatron.placement import R, Replicate, join_shards
from fxmegatron.verify.compare import describe_users, first_divergence, rel_err
from fxmegatron.verify.simulate import Recorder, forward_backward, run_ranks

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

    def __str__(self):
        return (f"verify {self.layout}: exact (loss {self.loss:.6f} vs {self.loss_ref:.6f}; largest gradient "
                f"difference {self.max_grad_err:.1e} at {self.worst_param}; {self.nodes} nodes per rank; "
                f"{self.seconds:.1f} s)\n{self.coverage.summary()}")


def fresh_batch(example, seed: int = 1):
    """A batch shaped like ``example`` with other values: integer inputs drawn from the
    example's range of non-negative values (negative entries, e.g. -100 labels, and the
    most frequent id, e.g. padding, kept in place, and half of the rest the example's own
    ids; 0/1 masks kept), float inputs redrawn
    with the example's mean and spread. Each input is drawn on its own, so inputs that
    were one tensor in the example (labels given as input_ids) differ here."""
    g = torch.Generator().manual_seed(seed)

    def redraw(x):
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.numel() == 0:
            return x
        if x.is_floating_point():
            return (torch.randn(x.shape, generator=g) * x.float().std().nan_to_num(1.0) + x.float().mean()
                    ).to(x.dtype)
        if bool(((x == 0) | (x == 1)).all()):
            return x.clone()
        # padding is the most frequent id of a padded batch: its positions keep it, so rules
        # that treat one id specially (an embedding's padding_idx) are exercised
        values, counts = x[x >= 0].unique(return_counts=True)
        keep = (x < 0) | ((x == values[counts.argmax()]) if counts.max() > 1 else torch.zeros_like(x, dtype=torch.bool))
        lo, hi = int(x[x >= 0].min()), int(x[x >= 0].max())
        new = torch.randint(lo, hi + 1, x.shape, generator=g, dtype=x.dtype)
        # half the other positions take one of the example's ids (so the pad id also appears
        # where the loss sees it), the rest ids drawn from its range
        seen = x[x >= 0]
        picked = seen[torch.randint(0, seen.numel(), x.shape, generator=g)]
        new = torch.where(torch.rand(x.shape, generator=g) < 0.5, picked, new)
        return torch.where(keep, x, new)
    return pytree.tree_map(redraw, example)


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


def verify(model: nn.Module, example_batch, *, tp: int = 2, sequence_parallel: bool = False,
           recompute="none", batch=None, seed: int = 0, loss_rtol: float = 1e-5,
           grad_rtol: float = 1e-4) -> VerifyReport:
    """Check the ``tp``-way layout of ``model`` on simulated ranks; see the module doc.
    Returns a report when the parallel program is exact, raises ``VerificationError``
    otherwise. ``model`` needs real weights (a tiny config of the model is enough)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        raise VerificationError("verify runs the model: build it with real weights (a tiny config of the "
                                "same architecture checks the same rules in seconds)")
    t0 = time.perf_counter()
    layout = f"tp={tp}" + (" sp" if sequence_parallel else "") + (f" recompute={recompute}" if recompute != "none" else "")
    batch = fresh_batch(example_batch, seed + 1) if batch is None else batch
    ref_model = copy.deepcopy(model)
    cap = capture(model, example_batch)
    dropout = bool(dropout_sites(cap.gm))
    if dropout:
        ref_model.eval()
    inputs = pytree.tree_leaves(batch_args(batch))
    args, kwargs = batch_args(batch)
    loss_eager = LossOnly(ref_model)(*args, **kwargs)
    loss_eager.backward()
    eager_grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}

    ref_gm = copy.deepcopy(cap.gm)
    if dropout:
        _without_dropout(ref_gm)
    rec = Recorder(ref_gm)
    with torch.no_grad():
        loss_graph = rec.run(*inputs)[0]
    if rel_err(loss_graph, loss_eager.detach()) > loss_rtol:
        raise VerificationError(
            f"capture: the captured graph of {type(model).__name__} computes loss {loss_graph.item():.6f} on a "
            f"fresh batch where the model computes {loss_eager.item():.6f}: the graph does not read the batch "
            "as the model does (check the example batch: inputs that alias each other, inputs the model "
            "ignores, Python values that are constants in the graph)")

    graphs = [copy.deepcopy(cap.gm) for _ in range(tp)]
    plans, cov = [None] * tp, []

    def rank_body(rank: int, group_name: str):
        gm = graphs[rank]
        plans[rank] = transform_rank(gm, cap, tp, rank, group_name, sequence_parallel, seed)
        if rank == 0:   # as parallelize does: after the rewrite, before shapes become local
            cov.append(coverage(gm, plans[0], cap.params))
        local = assemble_local(gm, cap, plans[rank], rank, tp, "cpu", None, seed)
        apply_recompute(local, recompute)
        if dropout:
            local.eval()
        graphs[rank] = local
        return forward_backward(local, inputs)

    results = run_ranks(tp, rank_body)
    plan = plans[0]

    losses = [r["loss"] for r in results]
    loss = losses[0]
    bad_loss = rel_err(loss, loss_eager.detach()) > loss_rtol or any(rel_err(x, loss) > loss_rtol for x in losses)
    grad_errs, bad_grads = {}, []
    floor = 0.01 * max((g.abs().max().item() for g in eager_grads.values()), default=0.0)
    for name, ref in eager_grads.items():
        canon = cap.aliases.get(name, name)
        plc = plan.param_plc.get(canon, R)
        shards = [r["grads"].get(canon) for r in results]
        if any(s is None for s in shards):
            grad_errs[name] = float("inf")
            bad_grads.append((name, "no gradient reached it on some rank"))
            continue
        if isinstance(plc, Replicate):
            spread = max(rel_err(s, shards[0], floor) for s in shards)
            if spread > grad_rtol:
                bad_grads.append((name, f"replicated, but its gradient differs between ranks by {spread:.2e}"))
        whole = shards[0] if isinstance(plc, Replicate) else join_shards(shards, plc)
        grad_errs[name] = rel_err(whole, ref, floor)
        if grad_errs[name] > grad_rtol:
            bad_grads.append((name, f"gradient differs by {grad_errs[name]:.2e} (relative; tolerance {grad_rtol:g})"))
    if bad_loss or bad_grads:
        div = first_divergence(ref_gm.graph, rec.values, graphs[0].graph, [r["values"] for r in results],
                               max(loss_rtol, 1e-4))
        head = (f"verify {layout} of {type(model).__name__}: the parallel program differs from the model "
                f"(loss {loss.item():.6f} on rank 0, the model's {loss_eager.item():.6f})")
        if div is not None:
            raise VerificationError(f"{head}; first divergent {div}")
        name, why = bad_grads[0] if bad_grads else ("", "")
        canon = cap.aliases.get(name, name)
        raise VerificationError(f"{head}; every forward value agrees, but parameter {name} "
                                f"(placed {plan.param_plc.get(canon, R)}): {why}; it is used by "
                                f"{describe_users(graphs[0].graph, canon)}")
    worst = max(grad_errs, key=grad_errs.get) if grad_errs else ""
    nodes = sum(1 for _ in graphs[0].graph.nodes)
    return VerifyReport(layout, loss.item(), loss_eager.item(), grad_errs.get(worst, 0.0), worst, nodes,
                        time.perf_counter() - t0, cov[0])


__all__ = ["verify", "VerifyReport", "fresh_batch"]
