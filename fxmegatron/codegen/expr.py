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
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

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


# ATen elementwise op -> sympy form (args already lowered)
def _lower(node: fx.Node, a: List) -> sp.Expr:
    pk = getattr(node.target, "overloadpacket", node.target)
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
               aten.gelu, aten.erf, aten.pow, aten.sqrt, aten.rsqrt}


@dataclass
class Chain:
    """Forward and backward expressions of an elementwise group."""

    inputs: Tuple[sp.Symbol, ...]            # x0, x1, ...: the group's tensor inputs
    outputs: Tuple[sp.Expr, ...]             # one per group output
    grad_outputs: Tuple[sp.Symbol, ...]      # g0, g1, ...: gradients arriving at the outputs
    grads: Tuple[sp.Expr, ...]               # d loss / d x_i, one per input

    def backward_cse(self):
        """(shared subexpressions, gradient expressions) after CSE."""
        return sp.cse(list(self.grads), symbols=sp.numbered_symbols("t"), optimizations="basic")


def lower_nodes(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> Chain:
    """Expressions for ``outputs`` of the elementwise ``nodes`` over ``inputs`` (scalars inline)."""
    syms = sp.symbols(f"x0:{len(inputs)}", real=True)
    env: Dict[fx.Node, sp.Expr] = dict(zip(inputs, syms))
    for n in nodes:
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
    return derive(syms, outs)


def derive(inputs: Sequence[sp.Symbol], outputs: Sequence[sp.Expr]) -> Chain:
    """Backward of ``outputs`` (expressions over ``inputs``) by symbolic differentiation."""
    gsyms = sp.symbols(f"g0:{len(outputs)}", real=True)
    grads = tuple(sp.Add(*[g * sp.diff(o, x) for g, o in zip(gsyms, outputs)]) for x in inputs)
    return Chain(tuple(inputs), tuple(outputs), tuple(gsyms), grads)
