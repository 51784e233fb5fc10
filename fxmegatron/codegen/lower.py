"""Graph nodes -> ``Chain``: a group of elementwise fx nodes lowered to sympy expressions.

Each ATen elementwise op (``ELEMENTWISE``) has a sympy form; a counter-based dropout
node becomes a mask symbol and ``rotate_half`` of an input the rotated-input symbol.
This is the one part of code generation that knows the graph's ops: it imports
``fxmegatron.ops.dropout``, which in turn runs its GPU form through a generated kernel
(``fxmegatron.codegen.fused_chain``). The symbolic chain itself is
``fxmegatron.codegen.expr``, below both.
"""
from __future__ import annotations

import math
import operator
from typing import Dict, List, Sequence

import sympy as sp
import torch
import torch.fx as fx

from fxmegatron.codegen.expr import Chain, DropoutSite, Sigmoid, derive, gelu, rotate_half, rotate_symbol
from fxmegatron.ops.dropout import counter_dropout

aten = torch.ops.aten


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


def lower_nodes(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> Chain:
    """Expressions for ``outputs`` of the elementwise ``nodes`` over ``inputs`` (scalars inline).

    Besides ATen elementwise ops, a node may be ``fxmegatron.ops.dropout.counter_dropout`` (a mask
    symbol) or ``rotate_half`` of an input (the rotated-input symbol)."""
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
