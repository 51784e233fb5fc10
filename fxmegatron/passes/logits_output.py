"""A program whose output is the logits instead of the loss (``ParallelModel.logits``).

The logits are found from the loss, since a captured graph names no "LM head": the one
cross-entropy of the graph (``aten.cross_entropy_loss``, the vocab-parallel form the
tensor-parallel rewrite makes of it, or ``nll_loss`` over a ``log_softmax``) reads them,
usually through ops that only reshape, cast or shift them on the way (``view(-1, V)``,
HF's ``.float()``, a ``[..., :-1, :]`` shift). Walking back through those ops, the logits
are the tensor of most dims there, the one nearest the LM head among equals: the LM head's
[B, S, V] output as the model computes it (and as HF returns it), before the loss's
flattening, upcast or shift. A soft-capping or a vocab-dim slice is not walked through:
it is part of the logits the model hands its loss.

The new module shares the parameters and submodules of the one it is cut from; the loss
and whatever only it needs (the labels' shift, the collectives of a vocab-parallel loss)
are dead code and gone. Nothing in the given module changes.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.fx as fx

from fxmegatron.errors import PassError
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
from fxmegatron.placement import placed

aten = torch.ops.aten

# ops that hand on the same values, reshaped, recast or copied (a slice: see _walks_through)
_PASS_ON = {aten.view, aten.reshape, aten._unsafe_view, aten.to, aten._to_copy, aten.clone, aten.contiguous,
            aten.alias, aten.detach, aten.flatten, aten.slice}
_NLL = {aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d, aten.nll_loss_forward}
_LOG_SOFTMAX = {aten.log_softmax, aten._log_softmax}


def _family(n: fx.Node):
    return getattr(n.target, "overloadpacket", n.target) if n.op == "call_function" else None


def _losses(gm: fx.GraphModule) -> List[Tuple[fx.Node, object]]:
    """Every cross-entropy of ``gm``, as (loss node, the node it reads its logits from)."""
    out = []
    for n in gm.graph.nodes:
        f = _family(n)
        if n.target is vocab_parallel_cross_entropy or f is aten.cross_entropy_loss:
            out.append((n, n.args[0]))
        elif f in _NLL and isinstance(n.args[0], fx.Node):
            x = n.args[0]
            while _family(x) not in _LOG_SOFTMAX and _walks_through(x):
                x = x.args[0]
            if _family(x) in _LOG_SOFTMAX and x.args[1] % max(_ndim(x), 1) == _ndim(x) - 1:
                out.append((n, x.args[0]))     # a log-softmax over the classes (the last dim)
    return out


def _ndim(n) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.ndim if isinstance(v, torch.Tensor) else -1


def _walks_through(n: fx.Node) -> bool:
    """Whether the walk back from the loss goes on past ``n`` to its input."""
    if _family(n) not in _PASS_ON or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if _family(n) is aten.slice:     # the loss's shift along the sequence, not a cut of the vocabulary
        nd = _ndim(n)
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        return nd > 0 and dim % nd != nd - 1
    return True


def find_logits(gm: fx.GraphModule) -> fx.Node:
    """The node of ``gm`` that holds the logits (see the module's docstring); a ``PassError``
    naming the reason when the graph has no cross-entropy or more than one."""
    losses = _losses(gm)
    if not losses:
        raise PassError("no cross-entropy in the graph (aten.cross_entropy_loss, or nll_loss over a "
                        "log_softmax) to find the logits from: the model computes its loss some other way")
    if len(losses) > 1:
        raise PassError(f"{len(losses)} cross-entropies in the graph ({', '.join(n.name for n, _ in losses)}): "
                        "which one reads the logits is ambiguous")
    loss, n = losses[0]
    if not isinstance(n, fx.Node):
        raise PassError(f"the cross-entropy {loss.name} reads a constant, not logits computed in the graph")
    chain = [n]
    while _walks_through(chain[-1]):
        chain.append(chain[-1].args[0])
    best = max(_ndim(c) for c in chain)
    if best < 1:
        raise PassError(f"the logits read by {loss.name} ({chain[-1].name}) have no traced shape")
    return [c for c in chain if _ndim(c) == best][-1]


def logits_output(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with ``gm``'s inputs whose output is the logits node (``find_logits``),
    with what only the loss needs eliminated. Shares ``gm``'s parameters, buffers and
    submodules; runs the fx graph itself, not a ``torch.compile``d forward of ``gm``."""
    target = find_logits(gm)
    g = fx.Graph()
    env = {}
    g.graph_copy(gm.graph, env)
    g.output(env[target])
    out = fx.GraphModule(gm, g)
    # on the module, not the bare graph: a call_module's purity is looked up in its owner.
    # Attributes only the loss read stay: references to shared objects, and deleting
    # submodules could reach into a module the program shares
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def used_inputs(gm: fx.GraphModule) -> List[bool]:
    """For each placeholder of ``gm``, whether the graph reads it (the labels of a graph cut
    by ``logits_output`` it does not)."""
    return [len(n.users) > 0 for n in gm.graph.nodes if n.op == "placeholder"]


def output_placement(gm: fx.GraphModule):
    """How the tp ranks hold ``gm``'s (single) output, as the tensor-parallel rewrite recorded
    it (None where nothing was recorded)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0]
    return placed(node, "tp") if isinstance(node, fx.Node) else None
