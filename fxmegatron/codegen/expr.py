"""Elementwise chains as sympy expressions, and their backward derived symbolically.

A chain is one expression per output over input symbols ``x0, x1, ...``
(``fxmegatron.codegen.lower`` makes one from a group of graph nodes). Its gradient
with respect to each input is ``grad_out * d(out)/d(x_i)``, differentiated by sympy
and then shared through common-subexpression elimination. Forms that overflow when written naively use
functions with stable derivatives: ``Sigmoid`` (derivative s·(1−s)) stands for
1/(1+e^−x), and tanh is printed through it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import sympy as sp
import torch


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
