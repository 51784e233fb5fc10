"""Weights replicated over tp stay the same on every tp rank: a gradient each rank computes
alone is averaged over the ranks.

A weight replicated over tp that the ranks read in a replicated region (a mixture's router,
a norm without sequence parallelism, a block demoted to replicated) has its gradient computed
by every rank from the same values. In exact arithmetic the ranks agree; on a GPU they need
not: a kernel that accumulates with atomics (the scatter-adds of a router's backward) adds in
the order its threads arrive, so the ranks' gradients differ in their last bits, each rank's
optimizer applies its own, and the copies drift apart step by step. Measured on two H200
(an HF Qwen3-MoE of 64 experts, tp2 + sequence parallelism, compiled, bf16): the router
weights of 6 of 8 layers differed between the ranks after the first step and by up to 1e-3
after 13, after which the ranks route a token to different experts: two models trained as one
and no error (docs/TENSOR_PARALLEL.md, "Replicated weights"). A gradient that reaches the
weight through a collective is the same on every rank already: f's all-reduce (a norm's
weight under sequence parallelism), a sequence split's all-gather.

``average_redundant_grads`` reads each other such weight through ``ops.collectives.mean_grad``
(identity forward; backward the ranks' gradients summed by one all-reduce and divided by tp:
the same bits on every rank, the mean of values equal but for rounding). Precondition: the
graph is tp-rewritten (``gm.meta`` holds the plan, its ``param_plc`` naming each parameter's
placement) and its weights are ``get_attr`` nodes. Values computed from weights alone (a cast,
a transpose) are followed to their readers.
"""
from __future__ import annotations

from typing import Dict, List

import torch.fx as fx

from fxmegatron.ops.collectives import copy_to_tp, mean_grad, split_seq
from fxmegatron.placement import R, place

# the readers through which a replicated weight's gradient arrives the same on every rank
SAME_ON_EVERY_RANK = (copy_to_tp, split_seq)


def weights_only(n: fx.Node) -> bool:
    """Whether ``n`` is computed from graph attributes alone (a weight's cast, transpose, view)."""
    return n.op == "call_function" and bool(n.all_input_nodes) and all(
        a.op == "get_attr" or weights_only(a) for a in n.all_input_nodes)


def _same(n: fx.Node, memo: Dict[fx.Node, bool]) -> bool:
    """Whether every path from ``n`` to a computation passes through a collective that gives
    each rank the same gradient."""
    if n not in memo:
        memo[n] = all(u.target in SAME_ON_EVERY_RANK or (weights_only(u) and _same(u, memo)) for u in n.users)
    return memo[n]


def average_redundant_grads(gm: fx.GraphModule, param_plc, world: int, group_name: str) -> List[str]:
    """Insert a ``mean_grad`` after each weight replicated over tp that some reader uses without
    such a collective, for those readers; returns the weights' names (in graph order)."""
    if world == 1:
        return []
    memo: Dict[fx.Node, bool] = {}
    done = []
    for n in list(gm.graph.nodes):
        if n.op != "get_attr" or param_plc.get(n.target) != R or not n.users:
            continue
        alone = [u for u in n.users
                 if not (u.target in SAME_ON_EVERY_RANK or (weights_only(u) and _same(u, memo)))]
        if not alone:
            continue
        with gm.graph.inserting_after(n):
            m = gm.graph.call_function(mean_grad, (n, world, group_name))
        m.meta.update(n.meta)
        # the block that reads it (sharded data parallelism gathers a weight for its block)
        m.meta["nn_module_stack"] = alone[0].meta.get("nn_module_stack", n.meta.get("nn_module_stack"))
        m.meta["tp_rule"] = "collective (a replicated weight's gradients averaged)"
        place(m, "tp", R)
        for u in alone:
            u.replace_input_with(n, m)
        done.append(n.target)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
