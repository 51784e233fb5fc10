"""Elementwise chains as sympy expressions, and their backward derived symbolically.

A chain of elementwise ATen nodes becomes one expression per output over input
symbols ``x0, x1, ...``. Its gradient with respect to each input is
``grad_out * d(out)/d(x_i)``, differentiated by sympy and then shared through
common-subexpression elimination. Forms that overflow when written naively use
functions with stable derivatives: ``Sigmoid`` (derivative s·(1−s)) stands for
1/(1+e^−x), and tanh is printed through it.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import sympy as sp
import torch
import torch.fx as fx

aten = torch.ops.aten


class Sigmoid(sp.Function):
    """1 / (1 + exp(-x)), kept whole so that it and its derivative s·(1−s) never overflow."""

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)


SQRT_2_OVER_PI = sp.Float(math.sqrt(2.0 / math.pi), 17)


def gelu(x, approximate: str = "none"):
    if approximate == "tanh":
        return sp.Float(0.5) * x * (1 + sp.tanh(SQRT_2_OVER_PI * (x + sp.Float(0.044715) * x ** 3)))
    return sp.Float(0.5) * x * (1 + sp.erf(x / sp.sqrt(2)))


def _arg(node, i, name, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _true(c):
    """A 0/1 (bool-loaded) symbol as a sympy condition."""
    return sp.StrictGreaterThan(c, sp.Float(0.5))


def _value(v):
    if isinstance(v, float) and math.isinf(v):
        return sp.oo if v > 0 else -sp.oo
    return sp.Float(v) if isinstance(v, float) else v


# ATen elementwise op -> sympy form (args already lowered)
def _lower(node: fx.Node, a: List) -> sp.Expr:
    pk = getattr(node.target, "overloadpacket", node.target)
    if pk is aten.where:
        return sp.Piecewise((_value(a[1]), _true(a[0])), (_value(a[2]), True))
    if pk is aten.masked_fill:
        return sp.Piecewise((_value(a[2]), _true(a[1])), (a[0], True))
    if pk is aten.add:
        return a[0] + _arg(node, 2, "alpha", 1) * a[1]
    if pk is aten.sub:
        return a[0] - _arg(node, 2, "alpha", 1) * a[1]
    if pk in (aten.mul, operator.mul):
        return a[0] * a[1]
    if pk in (aten.div, operator.truediv):
        return a[0] / a[1]
    if pk is aten.neg:
        return -a[0]
    if pk is aten.exp:
        return sp.exp(a[0])
    if pk is aten.tanh:
        return sp.tanh(a[0])
    if pk is aten.sigmoid:
        return Sigmoid(a[0])
    if pk is aten.silu:
        return a[0] * Sigmoid(a[0])
    if pk is aten.gelu:
        return gelu(a[0], _arg(node, 1, "approximate", "none"))
    if pk is aten.erf:
        return sp.erf(a[0])
    if pk is aten.pow:
        e = a[1]
        if isinstance(e, sp.Float) and float(e).is_integer():   # x ** 3.0 is x*x*x, defined for x < 0
            e = sp.Integer(int(e))
        return a[0] ** e
    if pk is aten.sqrt:
        return sp.sqrt(a[0])
    if pk is aten.rsqrt:
        return 1 / sp.sqrt(a[0])
    raise NotImplementedError(f"{node.target} has no elementwise form")


ELEMENTWISE = {aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.exp, aten.tanh, aten.sigmoid, aten.silu,
               aten.gelu, aten.erf, aten.pow, aten.sqrt, aten.rsqrt, aten.where, aten.masked_fill}


@dataclass(frozen=True)
class DropoutSite:
    """A dropout inside a chain: ``mask`` (a 0/1 symbol in the expressions) is drawn in the kernel
    by ``tl.rand`` from the key input ``key`` (see ``fxmegatron.ops.dropout``) at each element's index in
    the unsplit tensor, and drawn again in backward: never stored."""

    mask: sp.Symbol
    key: int                          # index of the key input ([mixed seed, step], int64)
    site: int
    p: float
    global_shape: Tuple[int, ...]
    shard_dim: int = -1               # this rank holds [start, start + local) of shard_dim
    start: int = 0


@dataclass
class Chain:
    """Forward and backward expressions of an elementwise group.

    ``rotated`` maps an input index i to the symbol standing for rotate_half(x_i) at the same
    position (the last dim's halves swapped, the first negated): the rotary embedding's
    ``cat(-x2, x1)``. Its gradient reaches x_i through the transposed rotation."""

    inputs: Tuple[sp.Symbol, ...]            # x0, x1, ...: the group's tensor inputs
    outputs: Tuple[sp.Expr, ...]             # one per group output
    grad_outputs: Tuple[sp.Symbol, ...]      # g0, g1, ...: gradients arriving at the outputs
    grads: Tuple[sp.Expr, ...]               # d loss / d x_i, one per input (direct terms)
    dropouts: Tuple[DropoutSite, ...] = ()
    rotated: Dict[int, sp.Symbol] = field(default_factory=dict)
    rot_grads: Dict[int, sp.Expr] = field(default_factory=dict)   # d loss / d rotate_half(x_i)

    def backward_cse(self):
        """(shared subexpressions, gradient expressions) after CSE."""
        return sp.cse(list(self.grads), symbols=sp.numbered_symbols("t"), optimizations="basic")


def dropout_chain(p: float, site: int, global_shape: Tuple[int, ...] = (), shard_dim: int = -1,
                  start: int = 0) -> Chain:
    """A lone dropout: x0 · m · 1/(1−p) with the key as input x1."""
    x0, x1, m = sp.symbols("x0 x1 m0", real=True)
    return derive([x0, x1], [x0 * m * sp.Float(1 / (1 - p))],
                  [DropoutSite(m, 1, site, p, tuple(global_shape), shard_dim, start)])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's rotation: last dim's halves swapped, the first negated. A graph
    node calling it lowers to the rotated-input symbol of its argument."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_symbol(i: int) -> sp.Symbol:
    return sp.Symbol(f"r{i}", real=True)


def lower_nodes(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> Chain:
    """Expressions for ``outputs`` of the elementwise ``nodes`` over ``inputs`` (scalars inline).

    Besides ATen elementwise ops, a node may be ``fxmegatron.ops.dropout.counter_dropout`` (a mask
    symbol) or ``rotate_half`` of an input (the rotated-input symbol)."""
    from fxmegatron.ops.dropout import counter_dropout

    syms = sp.symbols(f"x0:{len(inputs)}", real=True)
    env: Dict[fx.Node, sp.Expr] = dict(zip(inputs, syms))
    index = {n: i for i, n in enumerate(inputs)}
    dropouts, rotated = [], {}
    for n in nodes:
        if n.target is rotate_half:
            i = index[n.args[0]]
            rotated[i] = rotate_symbol(i)
            env[n] = rotated[i]
            continue
        if n.target is counter_dropout:
            x, p, _train, key, site, gshape = n.args[:6]
            shard_dim, slices = (n.args[6], n.args[7]) if len(n.args) > 7 else (-1, ())
            start = slices[0][0] if slices else 0
            m = sp.Symbol(f"m{len(dropouts)}", real=True)
            dropouts.append(DropoutSite(m, index[key], site, float(p), tuple(gshape), shard_dim, start))
            env[n] = env[x] * m * sp.Float(1.0 / (1.0 - p))
            continue
        args = []
        for a in n.args:
            if isinstance(a, fx.Node):
                args.append(env[a])
            elif isinstance(a, (int, float)):
                args.append(sp.Float(a) if isinstance(a, float) else sp.Integer(a))
            else:
                args.append(a)
        env[n] = _lower(n, args)
    outs = tuple(env[o] for o in outputs)
    return derive(syms, outs, dropouts, rotated)


def derive(inputs: Sequence[sp.Symbol], outputs: Sequence[sp.Expr], dropouts: Sequence[DropoutSite] = (),
           rotated: Optional[Dict[int, sp.Symbol]] = None) -> Chain:
    """Backward of ``outputs`` (expressions over ``inputs``, mask and rotation symbols) by symbolic
    differentiation; masks are constants of the derivative."""
    gsyms = sp.symbols(f"g0:{len(outputs)}", real=True)

    def grad(x):
        return sp.Add(*[g * sp.diff(o, x) for g, o in zip(gsyms, outputs)])

    rotated = dict(rotated or {})
    grads = tuple(grad(x) for x in inputs)
    rot_grads = {i: grad(r) for i, r in rotated.items()}
    return Chain(tuple(inputs), tuple(outputs), tuple(gsyms), grads, tuple(dropouts), rotated, rot_grads)
