"""What the recogniser's walks share: a ``Step`` (a name and what it requires of the graph), the
``Trail`` of nodes a walk has seen (listed in its error), and small readers of chains of casts,
reshapes and dim permutations between the ops a step pairs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Collection, Iterable, List, NoReturn, Optional, Tuple

import torch
import torch.fx as fx

from fxmegatron.errors import ExpertParallelError
from fxmegatron.passes.tensor_parallel.nodes import packet, val
from fxmegatron.passes.tensor_parallel.rules.views import permutation

aten = torch.ops.aten

# ops that change a tensor's dtype or copy it, never its values' places
CASTS = frozenset({aten.to, aten._to_copy, aten.type_as, aten.clone, aten.contiguous, aten.alias})
# ops that regroup dims, keeping the values' order
RESHAPES = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.flatten})
PERMUTES = frozenset({aten.transpose, aten.t, aten.permute, aten.numpy_T})
SPLITS = frozenset({aten.chunk, aten.split, aten.split_with_sizes, aten.slice})
# matmuls of an activation by a 2-D weight (routers, shared experts): (op, index of the weight)
LINEARS = {aten.linear: 1, aten.mm: 1, aten.matmul: 1, aten.addmm: 2}


@dataclass(frozen=True)
class Step:
    """One step of a walk: ``requires`` says what the graph must hold there (the precondition
    the error quotes when it does not)."""
    name: str
    requires: str


def describe(n) -> str:
    """How the error lists a node: its name and target."""
    if not isinstance(n, fx.Node):
        return repr(n)
    if n.op == "call_function":
        return f"{n.name} ({n.target})"
    if n.op == "get_attr":
        return f"{n.name} (get_attr {n.target})"
    return f"{n.name} ({n.op})"


class Trail:
    """The nodes a walk has seen, in order, and the module it walks in (the experts' module
    until the block's own is known)."""

    def __init__(self, module: str, start: fx.Node):
        self.module = module
        self.seen: List[fx.Node] = [start]

    def see(self, *nodes) -> None:
        for n in nodes:
            if isinstance(n, fx.Node) and n not in self.seen:
                self.seen.append(n)

    def fail(self, step: Step, found: str) -> NoReturn:
        raise ExpertParallelError(
            f"cannot follow the mixture-of-experts computation in {self.module or '(top level)'}: step "
            f"'{step.name}' requires {step.requires}, but {found}. Nodes seen along the walk: "
            f"{', '.join(describe(n) for n in self.seen)}")

    def expect(self, ok: bool, step: Step, found) -> None:
        """``found``: a string, or a callable giving one (only called on failure)."""
        if not ok:
            self.fail(step, found() if callable(found) else found)


def is_call(n, *packets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and packet(n) in packets


def is_item(n, of, i: int) -> bool:
    """``n`` is ``getitem(x, i)`` of a node ``x`` whose op is ``of``."""
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem
            and n.args[1] == i and is_call(n.args[0], of))


def item_of(n: fx.Node, i: int) -> Optional[fx.Node]:
    """The reader ``getitem(n, i)`` of a tuple-valued node, if any."""
    return next((u for u in n.users if u.target is operator.getitem and u.args[1] == i), None)


def under(x, ops: Collection, trail: Optional[Trail] = None):
    """The node under a chain of ``ops`` (each read through its first argument) from ``x``."""
    while isinstance(x, fx.Node) and x.op == "call_function" and packet(x) in ops:
        if trail is not None:
            trail.see(x)
        x = x.args[0]
    if trail is not None:
        trail.see(x)
    return x


def param_under(x, params: Collection[str]) -> Optional[Tuple[fx.Node, Tuple[int, ...]]]:
    """(the parameter's get_attr, dim map) when ``x`` is a parameter seen through casts and dim
    permutations (``W.transpose(-2, -1)``, ``W.T``, permute): dim i of ``x`` is dim map[i] of
    the parameter. None otherwise."""
    chain = []
    while isinstance(x, fx.Node) and x.op == "call_function":
        if packet(x) not in CASTS and (val(x.args[0]) is None or permutation(x, val(x.args[0]).ndim) is None):
            break
        chain.append(x)
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "get_attr" and x.target in params and val(x) is not None):
        return None
    dmap = list(range(val(x).ndim))
    for op in reversed(chain):
        if packet(op) not in CASTS:
            dmap = [dmap[p] for p in permutation(op, len(dmap))]
    return x, tuple(dmap)


def linear_weight_operand(n: fx.Node):
    """The weight operand of a linear-like matmul (``LINEARS``), None for another node."""
    i = LINEARS.get(packet(n)) if n.op == "call_function" else None
    return n.args[i] if i is not None and len(n.args) > i else None


def linear_weight(n: fx.Node, params: Collection[str]) -> Optional[str]:
    """The parameter a linear-like matmul (``LINEARS``) multiplies by, if it is one."""
    w = linear_weight_operand(n)
    p = param_under(w, params) if w is not None else None
    return p[0].target if p is not None else None


def ancestors(x: fx.Node) -> set:
    """Every node ``x`` is computed from, ``x`` included."""
    seen, todo = {x}, [x]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def common_module(paths: Iterable[str]) -> str:
    """The deepest module that holds every one of ``paths`` (dotted)."""
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for names in zip(*parts):
        if any(n != names[0] for n in names):
            break
        out.append(names[0])
    return ".".join(out)
