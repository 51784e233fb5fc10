"""Whether a graph's loss can be split over microbatches and data-parallel shares exactly.

A step that splits the batch runs the graph on each piece and adds the pieces' losses with
weights (``runtime.microbatches.loss_weights``): each piece's mean cross-entropy weighted by its
share of the counted tokens, so that the sum is the mean over every counted token of the
batch, which is what the unmodified model computes on the whole batch. That holds for a
loss that is, from the graph's output back:

* views, ``alias``, ``clone``, ``contiguous`` and dtype casts (rounding aside, the value),
* multiplication or division by a constant (a number in the graph: linear, so the
  weighted sum of the scaled pieces is the scaled whole),
* down to one cross-entropy with mean reduction over the counted (not ignored) labels and
  no class weights (whose mean would divide by a sum of class weights, not a count).

Nothing else is known to be additive. A term added to it (an MoE router's load-balancing
loss computed from routing statistics of the whole batch, a z-loss, a regulariser over the
weights) is not a sum over the pieces, and a loss that is not a cross-entropy at all (a
mean squared error, a sum-reduced loss) is not weighted by counted tokens: ``split_loss_problem``
says why such a loss cannot be split and names the node where it stops being the
cross-entropy alone. Pure: reads the graph, changes nothing.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.passes.tensor_parallel.nodes import arg, packet
from fxmegatron.passes.views import VIEWS

aten = torch.ops.aten
# ops that hand on the loss's value (up to the rounding of a cast)
_SAME_VALUE = frozenset(VIEWS | {aten.alias.default, aten.clone.default, aten.contiguous.default,
                                 aten._to_copy.default, aten.squeeze.default, aten.squeeze.dim,
                                 aten.squeeze.dims})
_SCALE = frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar})
_DIVIDE = frozenset({aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.div_.Scalar})
_ADD = frozenset({aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor})

STATEMENT = ("a step that splits the batch is exact for a mean cross-entropy over the counted labels (up to views, "
             "dtype casts and scaling by a constant): each piece's loss is weighted by its share of the counted "
             "tokens")


def _is_cross_entropy(n) -> bool:
    from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy
    return isinstance(n, fx.Node) and n.op == "call_function" and (
        n.target is aten.cross_entropy_loss.default or n.target is vocab_parallel_cross_entropy)


def _ce_problem(n: fx.Node) -> Optional[str]:
    """Why this cross-entropy is not a mean over counted tokens, or None."""
    if n.target is aten.cross_entropy_loss.default:
        reduction, weight = arg(n, 3, "reduction", 1), arg(n, 2, "weight", None)
    else:
        reduction, weight = n.args[4], None
    if weight is not None:
        return "has class weights: its mean divides by the weights of the labels, not by their count"
    if reduction != 1:
        return (f"is reduced by {'sum' if reduction == 2 else 'none'}, not by the mean over counted tokens that "
                "the pieces are weighted for")
    return None


def _same_value_op(n: fx.Node) -> bool:
    return n.target in _SAME_VALUE or packet(n) is aten.to


def _scaled(n: fx.Node) -> Optional[fx.Node]:
    """The tensor operand of a multiplication or division of it by a number, else None."""
    if n.target in _SCALE and len(n.args) == 2:
        a, b = n.args
        if isinstance(a, fx.Node) and isinstance(b, (int, float)):
            return a
        if isinstance(b, fx.Node) and isinstance(a, (int, float)):
            return b
    if n.target in _DIVIDE and len(n.args) == 2 and isinstance(n.args[0], fx.Node) \
            and isinstance(n.args[1], (int, float)):
        return n.args[0]
    return None


def loss_chain(x) -> object:
    """The node under ``x``'s chain of value-keeping ops and constant scalings: the cross-entropy
    when the loss is one alone, else where something else enters."""
    while isinstance(x, fx.Node) and x.op == "call_function" and not _is_cross_entropy(x):
        if _same_value_op(x) and x.args and isinstance(x.args[0], fx.Node):
            x = x.args[0]
        elif _scaled(x) is not None:
            x = _scaled(x)
        else:
            break
    return x


def _class_of(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    cls = list(stack.values())[-1][1]
    return (cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))).rsplit(".", 1)[-1]


def place(n: fx.Node) -> str:
    """A node as an error names it: name, op, module path (and class), the model's source line."""
    mod, cls = module_path(n), _class_of(n)
    where = f"in {mod}" if mod else "at the top level"
    notes = [cls] if cls else []
    trace = (n.meta.get("stack_trace") or "").strip().splitlines()
    if len(trace) >= 2 and trace[-2].strip().startswith("File "):
        frame = trace[-2].strip().split('"')
        file = frame[1].rsplit("/", 1)[-1] if len(frame) > 1 else ""
        lineno = trace[-2].rsplit("line ", 1)[-1].split(",")[0]
        notes.append(f"{file}:{lineno} `{trace[-1].split('  #')[0].strip()}`")
    return f"node {n.name} ({packet(n)}) {where}{' (' + '; '.join(notes) + ')' if notes else ''}"


def _reads(term: fx.Node, limit: int = 4) -> List[str]:
    """The modules a term is computed from: the nearest ancestors with a module path (or the
    parameters it reads where no module comes between)."""
    seen, out, stack = set(), [], [term]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        mod = module_path(n) if n is not term else ""
        if n.op == "get_attr":
            mod = str(n.target)
        if mod:
            if mod not in out:
                out.append(mod)
            continue
        stack.extend(n.all_input_nodes)
    return sorted(out)[:limit] + (["..."] if len(out) > limit else [])


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return loss_chain(out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0])


def _cross_entropy_and_term(at):
    """(the cross-entropy, the term) when ``at`` adds a term to a cross-entropy, else None."""
    if not (isinstance(at, fx.Node) and at.op == "call_function" and at.target in _ADD and len(at.args) >= 2
            and all(isinstance(a, fx.Node) for a in at.args[:2])):
        return None
    sides = [loss_chain(a) for a in at.args[:2]]
    return next(((ce, term) for ce, term in ((sides[0], at.args[1]), (sides[1], at.args[0]))
                 if _is_cross_entropy(ce)), None)


def cross_entropy_and_term(gm: fx.GraphModule):
    """(the cross-entropy, the term) when the graph's loss adds a term to its cross-entropy (the
    node ``split_loss_problem`` names when it says so), else None."""
    return _cross_entropy_and_term(_loss_node(gm))


def added_term(gm: fx.GraphModule) -> Optional[fx.Node]:
    """The term of ``cross_entropy_and_term``, or None."""
    found = cross_entropy_and_term(gm)
    return found[1] if found else None


def split_loss_problem(gm: fx.GraphModule) -> Optional[str]:
    """None when the graph's loss (its first output) is additive over pieces of the batch (see
    the module doc), else why not, naming the node where the loss stops being a mean
    cross-entropy alone, its module path and source line."""
    at = _loss_node(gm)
    if _is_cross_entropy(at):
        why = _ce_problem(at)
        return None if why is None else f"the loss's cross-entropy {place(at)} {why}"
    if not isinstance(at, fx.Node) or at.op != "call_function":
        return f"the loss is {getattr(at, 'name', at)!r}, not a cross-entropy computed in the graph"
    found = _cross_entropy_and_term(at)
    if found is not None:
        ce, term = found
        reads = _reads(term)
        return (f"the loss adds a term to its cross-entropy {ce.name} at {place(at)}: the term, "
                f"{term.name}{', computed from ' + ', '.join(reads) if reads else ''}, is not a mean over "
                "the counted tokens; the unmodified model computes it once on the whole batch (an MoE "
                "router's load-balancing loss from the routing statistics of every token) and its value "
                "there is not a weighted sum of its values on the pieces")
    ces = [n for n in gm.graph.nodes if _is_cross_entropy(n)]
    if ces:
        return (f"the loss is not its cross-entropy {ces[0].name} alone: {place(at)} combines it with other "
                "values, and only a mean cross-entropy (up to views, casts and constant scaling) is known to be "
                "a weighted sum over pieces of the batch")
    return (f"the loss is not a cross-entropy: it comes from {place(at)}, and only a mean cross-entropy over "
            "counted labels is known to be a weighted sum over pieces of the batch (other means are exact only "
            "when every row of the batch is computed independently, which fxmegatron does not prove)")


def split_by(microbatches: int, dp: int) -> str:
    parts = [f"microbatches={microbatches}"] if microbatches > 1 else []
    parts += [f"dp={dp}"] if dp > 1 else []
    return " and ".join(parts)


def check_split_loss(gm: fx.GraphModule, microbatches: int, dp: int,
                     term: Optional[Callable[[fx.GraphModule], Tuple[bool, str]]] = None) -> None:
    """Raise ``LossError`` when a step split into ``microbatches`` × ``dp`` pieces would not
    compute the graph's loss on the whole batch (``split_loss_problem``); nothing to check
    when the batch is not split. ``term``: for a loss that adds a term, (whether the layout
    computes it exactly after all, what the error adds) (``passes.batch_term.split_term``)."""
    if microbatches * dp == 1:
        return
    problem = split_loss_problem(gm)
    if problem is None:
        return
    if term is not None and added_term(gm) is not None:
        exact, note = term(gm)
        if exact:
            return
        problem += note
    from fxmegatron.errors import LossError
    raise LossError(
        f"parallelize({split_by(microbatches, dp)}) splits each step's batch into {microbatches * dp} pieces, but "
        f"{problem} ({STATEMENT}). To proceed: train this model without splitting the batch (microbatches=1 and no "
        "dp; tensor and pipeline parallelism still apply), or turn the term off in the model (Hugging Face MoE "
        "models: output_router_logits=False); fxmegatron has no per-microbatch form of such a term yet")
