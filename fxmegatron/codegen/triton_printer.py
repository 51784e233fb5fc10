"""sympy expressions printed as fp32 Triton, and the device helpers the printed code calls.

``triton_expr`` prints one expression. Where plain Triton is slow or inaccurate the
printed code calls helpers instead: ``_one_plus_erf`` for ``1 + erf`` (see
``fold_one_plus_erf``), and the flushed approximate ``_fexp``, ``_frcp`` and
``_fsigmoid``. ``with_helpers`` prepends the source of those a kernel calls.
"""
from __future__ import annotations

import sympy as sp
from sympy.printing.str import StrPrinter

from fxmegatron.codegen.expr import Sigmoid


class OnePlusErf(sp.Function):
    """1 + erf(z), printed through erfc so that the negative tail (GeLU's) keeps its relative
    accuracy, and cheaper than libdevice's erf (which bounded the erf-GeLU kernel)."""


class TritonPrinter(StrPrinter):
    """sympy -> Triton expressions (fp32)."""

    def _print_Float(self, e):
        return repr(float(e))

    def _print_Integer(self, e):
        return f"{int(e)}.0"

    def _print_Rational(self, e):
        return repr(float(e))

    def _print_NumberSymbol(self, e):      # pi, E, ...: their float value
        return repr(float(e))

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def _print_Infinity(self, e):
        return 'float("inf")'

    def _print_NegativeInfinity(self, e):
        return 'float("-inf")'

    def _print_Pow(self, e, rational=False):
        if e.is_number:            # sqrt(2), pi**-0.5, ...: a float literal
            return repr(float(e))
        b, x = self._print(e.base), e.exp
        if x.is_Integer and 0 < int(x) <= 4:
            return "(" + "*".join([f"({b})"] * int(x)) + ")"
        if x.is_Integer and -4 <= int(x) < 0:
            return "(1.0/(" + "*".join([f"({b})"] * -int(x)) + "))"
        if x == sp.Rational(1, 2):
            return f"tl.sqrt({b})"
        if x == sp.Rational(-1, 2):
            return f"tl.rsqrt({b})"
        return f"tl.exp(({self._print(x)})*tl.log({b}))"

    def _print_Mul(self, e):
        # numeric factors (sqrt(pi), 1/2, ...) folded into one float coefficient: a product,
        # never a division by a constant (an fp32 division is a long instruction sequence)
        nums = [f for f in e.args if f.is_number]
        rest = [f for f in e.args if not f.is_number]
        if not rest:
            return repr(float(e))
        body = "*".join(f"({self._print(f)})" if f.is_Add else self._print(f) for f in rest)
        if not nums:
            return body
        c = float(sp.Mul(*nums))
        return body if c == 1.0 else f"(-{body})" if c == -1.0 else f"{c!r}*{body}"

    def _print_Piecewise(self, e):
        (val, cond), rest = e.args[0], e.args[1:]
        other = self._print(rest[0].expr) if len(rest) == 1 and rest[0].cond == sp.true else \
            self._print(sp.Piecewise(*rest))
        return f"tl.where({self._print(cond)}, {self._print(val)}, {other})"

    def _print_Function(self, e):
        if e.is_number:
            return repr(float(e))
        a = ", ".join(self._print(x) for x in e.args)
        if isinstance(e, Sigmoid):
            return f"_fsigmoid({a})"
        if isinstance(e, OnePlusErf):
            return f"_one_plus_erf({a})"
        name = type(e).__name__
        if name == "tanh":    # through the sigmoid: no overflow for large |x|
            return f"(2.0*_fsigmoid(2.0*({a}))-1.0)"
        if name == "exp":
            return f"_fexp({a})"
        if name in ("erf", "log"):
            return f"tl.{name}({a})"
        raise NotImplementedError(f"no Triton form for {name}")

    def _print_exp(self, e):
        return f"_fexp({self._print(e.args[0])})"


def triton_expr(e: sp.Expr) -> str:
    """``e`` as one fp32 Triton expression."""
    return TritonPrinter().doprint(e)


# erfc(a), a >= 0, as t·exp(P(t) - a²) with t = 1/(1 + a/2): Numerical Recipes' erfcc form, with
# P of degree 7 (their 9) fitted here for relative error below 2.3e-6 everywhere (a weighted
# Chebyshev fit of log(erfc(a)/t) + a², see docs/CODEGEN.md): one reciprocal, seven FMAs and
# one exp, no branch. The erf GeLU's kernels are bound by their instructions; the two FMAs
# fewer are worth 3 to 5% there. fp32's rounding of a² (2e-5 relative near a = 9) dominates.
ONE_PLUS_ERF_SRC = """@triton.jit
def _one_plus_erf(z):
    a = tl.abs(z)
    t = _frcp(1.0 + 0.5 * a)
    p = 0.00900474071890512 + t * (0.23218685481967222 + t * (-0.8469398480660214
        + t * (0.6481493910428499 + t * -0.15992779760005704)))
    p = -1.2655091243560683 + t * (0.9996334690032697 + t * (0.38340459364772644 + t * p))
    e = t * _fexp(p - a * a)
    return tl.where(z >= 0, 2.0 - e, e)
"""


def fold_one_plus_erf(e: sp.Expr) -> sp.Expr:
    """``c + c*erf(u)`` -> ``c*OnePlusErf(u)`` and ``-c + c*erf(u)`` -> ``-c*OnePlusErf(-u)``
    in every sum (GeLU's forward has ``1 + erf``; its derivative, distributed by sympy,
    ``0.5 + 0.5*erf``). A lone erf stays libdevice's."""

    def fold(add):
        terms = list(add.args)
        for i, t in enumerate(terms):
            for f in t.atoms(sp.erf):
                coef = t / f
                if coef.has(f):
                    continue
                for sgn in (1, -1):
                    partner = sgn * coef
                    j = next((j for j, o in enumerate(terms) if j != i and o == partner), None)
                    if j is not None:
                        rest = [o for k, o in enumerate(terms) if k not in (i, j)]
                        return fold(sp.Add(*rest, partner * OnePlusErf(sgn * f.args[0]))) if rest else \
                            partner * OnePlusErf(sgn * f.args[0])
        return add

    return e.replace(lambda x: x.is_Add and x.has(sp.erf), fold)


# exp and 1/x as the GPU's approximate instructions with denormals flushed (ex2.approx.ftz,
# rcp.approx.ftz). tl.exp and ``/`` use the same approximations but wrap them in a denormal
# fix-up: range tests and rescaling multiplies that were a quarter of the erf GeLU's
# instructions, and its kernels are compute-bound. Flushed: results below 1.2e-38 become 0.
# The interpreter and ROCm (``_PLAIN_MATH``, set when the kernel file is written: see
# ``fxmegatron.codegen.kernel_cache``) run tl.exp and ``/``.
FAST_MATH_SRC = """@triton.jit
def _fexp(x):
    if _PLAIN_MATH:
        return tl.exp(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _frcp(x):
    if _PLAIN_MATH:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fsigmoid(x):
    return _frcp(1.0 + _fexp(-x))
"""


def with_helpers(src: str) -> str:
    """``src`` with the source of the helpers it calls put before it."""
    if "_one_plus_erf(" in src:
        src = ONE_PLUS_ERF_SRC + "\n\n" + src
    if any(f in src for f in ("_fexp(", "_frcp(", "_fsigmoid(")):
        src = FAST_MATH_SRC + "\n\n" + src
    return src
