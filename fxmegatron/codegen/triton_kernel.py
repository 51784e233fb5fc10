"""Triton source for an elementwise chain (forward, and backward that recomputes the chain).

The output is seen as [M, N] (N its last dim) and each kernel program owns a
[BM, BN] tile. An input is

* ``full``: the output's shape;
* ``row``: broadcast along every dim but the last (a bias); in backward its
  gradient is summed over the tile's rows in the kernel;
* ``bcast``: any other shape that broadcasts to the output (rotary cos/sin,
  an attention mask); its offset is computed from the tile's coordinates, and its
  gradient, when asked for, is stored at full size and summed on the host;
* ``key``: a dropout key (``fxmegatron.ops.dropout``), read as two scalars.

Loads are upcast to fp32, the arithmetic is fp32, stores cast to the output's
dtype. Dropout masks come from ``tl.randint4x`` (one Philox call per four elements)
and are drawn again in backward. The
backward saves only the chain's inputs and recomputes what it needs, so no
intermediate is ever stored. A rotated input (rotary embedding) is also loaded at
its partner column; its gradient adds the transposed rotation of the gradient
with respect to the rotated value, evaluated at the partner. Kernels are cached
by their source text.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import sympy as sp
import torch
from sympy.printing.str import StrPrinter

from fxmegatron.codegen.expr import Chain, Sigmoid

FULL, ROW, BCAST, KEY = "full", "row", "bcast", "key"
_UNIFORM_SCALE = 4.6566127342e-10      # triton.language.random.uint_to_uniform_float, 32-bit


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


def _pr(e) -> str:
    return TritonPrinter().doprint(e)


class OnePlusErf(sp.Function):
    """1 + erf(z), printed through erfc so that the negative tail (GeLU's) keeps its relative
    accuracy, and cheaper than libdevice's erf (which bounded the erf-GeLU kernel)."""


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
# The interpreter and ROCm (``_PLAIN_MATH``, set when the kernel file is written) run tl.exp and ``/``.
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


def _with_helpers(src: str) -> str:
    if "_one_plus_erf(" in src:
        src = ONE_PLUS_ERF_SRC + "\n\n" + src
    if any(f in src for f in ("_fexp(", "_frcp(", "_fsigmoid(")):
        src = FAST_MATH_SRC + "\n\n" + src
    return src


@dataclass(frozen=True)
class Layout:
    """What a kernel's source depends on besides the chain: the output shape, each broadcast
    input's shape (padded to the output's rank) and whether offsets need int64."""

    shape: Tuple[int, ...]
    bcast: Tuple[Optional[Tuple[int, ...]], ...]
    big: bool
    q4: bool = False      # dropout draws one Philox call per four aligned columns
    keep_reused: bool = True     # evict_last on broadcast inputs (see _Emitter.point)


def _bcast_offset(shape, ishape, rows: str, cols: str) -> str:
    """Offset into a contiguous ``ishape`` input broadcast to ``shape``, from [rows, cols] of the
    output viewed as [prod(shape[:-1]), shape[-1]]."""
    nd = len(shape)
    strides, acc = [0] * nd, 1
    for k in range(nd - 1, -1, -1):
        strides[k] = acc if ishape[k] != 1 else 0
        acc *= ishape[k]
    terms = [f"{cols} * {strides[-1]}"] if strides[-1] else []
    inner = 1
    for k in range(nd - 2, -1, -1):
        if strides[k]:
            coord = f"({rows} // {inner})" if inner > 1 else rows
            if k > 0:
                coord = f"({coord} % {shape[k]})"
            terms.append(f"{coord} * {strides[k]}")
        inner *= shape[k]
    return " + ".join(terms) or "0"


class _Emitter:
    """Lines of one kernel: loads and masks at the tile's positions (suffix "") and, for
    rotated inputs in backward, at the partner columns (suffix "_p")."""

    def __init__(self, chain: Chain, kinds: Sequence[str], layout: Layout):
        self.chain, self.kinds, self.layout = chain, list(kinds), layout
        self.xs = [str(s) for s in chain.inputs]
        self.lines: List[str] = []

    def add(self, line: str):
        self.lines.append("    " + line)

    def preamble(self):
        # one grid dim, column blocks fastest: programs that run together cover whole rows
        self.add("pid = tl.program_id(0)")
        if self.layout.big:
            self.add("pm = (pid // NB).to(tl.int64)")
            self.add("pn = (pid % NB).to(tl.int64)")
        else:
            self.add("pm = pid // NB")
            self.add("pn = pid % NB")
        self.add("cols1 = pn * BN + tl.arange(0, BN)")
        self.add("rows = (pm * BM + tl.arange(0, BM))[:, None]")
        self.add("cols = cols1[None, :]")
        self.add("mask = (rows < M) & (cols < N)")
        self.add("offs = rows * N + cols")
        if self.chain.rotated:
            self.add("H = N // 2")
            self.add("pcols = tl.where(cols < H, cols + H, cols - H)")
            self.add("poffs = rows * N + pcols")
            self.add("sgn = tl.where(cols < H, -1.0, 1.0)")
        for j, d in enumerate(self.chain.dropouts):
            k = self.xs[d.key]
            # Philox key (k0, k1) = (mixed seed + site mod 2**32, step): see fxmegatron.ops.dropout.philox_key
            self.add(f"sd{j} = (tl.load({k}_ptr + 1) << 32) + ((tl.load({k}_ptr) + {d.site}) % 4294967296)")

    def _gidx(self, d, offs: str) -> str:
        """Each element's index in the unsplit tensor of a dropout (single-slice shards only)."""
        if d.shard_dim < 0:
            return offs
        shape = self.layout.shape
        inner = math.prod(shape[d.shard_dim + 1:])
        li, gi = shape[d.shard_dim] * inner, d.global_shape[d.shard_dim] * inner
        return f"(({offs}) // {li}) * {gi} + {d.start * inner} + ({offs}) % {li}"

    def _random_words(self, j: int, d, offs: str, quarter: bool):
        """``rr{j}``: element g's random word is word g % 4 of Philox at counter g // 4
        (``tl.randint4x``, as ``fxmegatron.ops.dropout.philox_uniform``). With ``quarter`` (groups of
        four elements are aligned along the tile's columns) one Philox call serves four
        columns; otherwise each element calls it and keeps its own word."""
        if quarter:
            self.add(f"rq{j} = pn * (BN // 4) + tl.arange(0, BN // 4)")
            q = self._gidx(d, f"rows * N + rq{j}[None, :] * 4")
            self.add(f"ra0, ra1, ra2, ra3 = tl.randint4x(sd{j}, (({q}) >> 2).to(tl.uint32))")
            self.add(f"rr{j} = tl.interleave(tl.interleave(ra0, ra2), tl.interleave(ra1, ra3))")
        else:
            self.add(f"rg{j} = {self._gidx(d, offs)}")
            self.add(f"ra0, ra1, ra2, ra3 = tl.randint4x(sd{j}, (rg{j} >> 2).to(tl.uint32))")
            self.add(f"rw{j} = rg{j} & 3")
            self.add(f"rr{j} = tl.where(rw{j} == 0, ra0, tl.where(rw{j} == 1, ra1, tl.where(rw{j} == 2, ra2, ra3)))")

    def point(self, sfx: str, grads: bool, used: Optional[set] = None):
        """Loads (and dropout masks, rotations) at the tile (sfx "") or its partner columns ("_p");
        with ``used`` (names the expressions read), only those."""
        offs, cols = ("offs", "cols") if not sfx else ("poffs", "pcols")
        need = (lambda v: True) if used is None else (lambda v: v in used)
        for i, (x, k) in enumerate(zip(self.xs, self.kinds)):
            if k == KEY or (sfx and i in self.chain.rotated):    # a rotated input's partner load is made below
                continue
            if not need(x + sfx) and i not in self.chain.rotated:
                continue
            if k == FULL:
                idx, m = offs, "mask"
            elif k == ROW:
                idx, m = cols, f"{cols} < N"
            else:
                idx, m = _bcast_offset(self.layout.shape, self.layout.bcast[i], "rows", cols), "mask"
            # a broadcast input (rotary tables, a mask) is read again by other programs: keep it in
            # L2, as inductor does. Timed on an H200: rotary forward 0.0703 against 0.0711 ms without;
            # a bias (row) gained nothing, and evict_first on read-once inputs slowed them.
            ep = ", eviction_policy='evict_last'" if k == BCAST and self.layout.keep_reused else ""
            self.add(f"{x}{sfx} = tl.load({x}_ptr + {idx}, mask={m}, other=0{ep}).to(tl.float32)")
        if grads:
            for g in self.chain.grad_outputs:
                if need(f"{g}{sfx}"):
                    self.add(f"{g}{sfx} = tl.load({g}_ptr + {offs}, mask=mask, other=0).to(tl.float32)")
        for j, d in enumerate(self.chain.dropouts):
            if not need(f"{d.mask}{sfx}"):
                continue
            self._random_words(j, d, offs, quarter=self.layout.q4 and not sfx)
            self.add(f"rr{j} = rr{j}.to(tl.int32, bitcast=True)")      # tl.rand's uint -> [0, 1)
            self.add(f"rr{j} = tl.where(rr{j} < 0, -rr{j} - 1, rr{j}).to(tl.float32) * {_UNIFORM_SCALE!r}")
            self.add(f"{d.mask}{sfx} = tl.where(rr{j} >= {float(d.p)!r}, 1.0, 0.0)")
        for i, r in self.chain.rotated.items():
            x = self.xs[i]
            if sfx:    # rotate_half(x) at the partner: -sgn * x here
                self.add(f"{r}_p = -sgn * {x}")
            else:
                self.add(f"{x}_p = tl.load({x}_ptr + poffs, mask=mask, other=0).to(tl.float32)")
                self.add(f"{r} = sgn * {x}_p")


def forward_source(chain: Chain, kinds: Sequence[str], name: str, layout: Layout) -> str:
    em = _Emitter(chain, kinds, layout)
    outs = [f"y{i}" for i in range(len(chain.outputs))]
    head = ["@triton.jit",
            f"def {name}({', '.join(x + '_ptr' for x in em.xs + outs)}, M, N, NB, BM: tl.constexpr, "
            "BN: tl.constexpr):"]
    em.preamble()
    em.point("", grads=False)
    for o, e in zip(outs, chain.outputs):
        em.add(f"{o} = {_pr(fold_one_plus_erf(e))}")
        em.add(f"tl.store({o}_ptr + offs, {o}.to({o}_ptr.dtype.element_ty), mask=mask)")
    return _with_helpers("\n".join(head + em.lines) + "\n")


def _partner(e: sp.Expr, chain: Chain) -> sp.Expr:
    syms = list(chain.inputs) + list(chain.grad_outputs) + [d.mask for d in chain.dropouts] + \
        list(chain.rotated.values())
    return e.xreplace({s: sp.Symbol(f"{s}_p", real=True) for s in syms})


def backward_source(chain: Chain, kinds: Sequence[str], name: str, layout: Layout,
                    needs: Optional[Sequence[bool]] = None) -> str:
    """Gradients of the inputs in ``needs`` (default: all but keys). Full inputs' gradients are
    stored per element; a row input's is summed over the tile's rows (one fp32 partial per
    row block); a broadcast input's is stored at full size in fp32."""
    em = _Emitter(chain, kinds, layout)
    gs = [str(s) for s in chain.grad_outputs]
    needs = [k != KEY for k in kinds] if needs is None else [bool(n) and k != KEY for n, k in zip(needs, kinds)]
    dxs = [f"d{x}" for x, k in zip(em.xs, kinds) if k != KEY]
    head = ["@triton.jit",
            f"def {name}({', '.join(v + '_ptr' for v in em.xs + gs + dxs)}, M, N, NB, BM: tl.constexpr, "
            "BN: tl.constexpr):"]
    em.preamble()
    want = [i for i, n in enumerate(needs) if n]
    exprs = [chain.grads[i] for i in want]
    rot = [i for i in want if i in chain.rotated]
    exprs += [_partner(chain.rot_grads[i], chain) for i in rot]
    exprs = [fold_one_plus_erf(e) for e in exprs]
    # load only what the gradients read (a mask's gradient never needs the masked values)
    used = {str(v) for e in exprs for v in e.free_symbols}
    em.point("", grads=True, used=used)
    if rot:
        em.point("_p", grads=True, used=used)
    shared, red = sp.cse(exprs, symbols=sp.numbered_symbols("t"), optimizations="basic")
    for s_, e in shared:
        em.add(f"{s_} = {_pr(e)}")
    val = dict(zip(want, red[:len(want)]))
    rval = dict(zip(rot, red[len(want):]))
    for i in want:
        d, k = f"d{em.xs[i]}", kinds[i]
        if val[i].free_symbols:
            em.add(f"{d} = {_pr(val[i])}")
        else:    # a constant gradient still fills a tile
            em.add(f"{d} = tl.zeros([BM, BN], dtype=tl.float32) + {_pr(val[i])}")
        if i in rval:    # the transposed rotation: -rotate_half of the rotated value's gradient
            em.add(f"{d} = {d} - sgn * ({_pr(rval[i])})")
        if k == ROW:
            em.add(f"{d} = tl.sum(tl.where(mask, {d}, 0.0), axis=0)")
            em.add(f"tl.store({d}_ptr + pm * N + cols1, {d}, mask=cols1 < N)")
        else:
            em.add(f"tl.store({d}_ptr + offs, {d}.to({d}_ptr.dtype.element_ty), mask=mask)")
    return _with_helpers("\n".join(head + em.lines) + "\n")


def kernels_run(x: torch.Tensor, interpreter: bool = True) -> bool:
    """Whether generated kernels run on ``x``: a real tensor (shape propagation runs ops on
    fake and meta ones) on a GPU, or on CPU under ``TRITON_INTERPRET=1`` when ``interpreter``.
    Never while torch.compile traces: inductor then generates the kernels of the torch form."""
    from torch._subclasses.fake_tensor import is_fake
    if torch.compiler.is_compiling() or is_fake(x) or x.device.type == "meta":
        return False
    return x.is_cuda or (interpreter and os.environ.get("TRITON_INTERPRET") == "1")


def table_kernels_run(x: torch.Tensor) -> bool:
    """``kernels_run`` for the multi-tensor kernels that read tensor addresses from a table
    (``FusedAdamW``, the fp32 gradient accumulation): not on CUDA tensors under
    ``TRITON_INTERPRET=1``, where the interpreter copies tensor arguments to the host and the
    device addresses in the table would be read on the host."""
    if x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return kernels_run(x)


def kernels_in_compiled_graph(x: torch.Tensor) -> bool:
    """Whether torch.compile is tracing ``x`` for a device where kernels run: an op that runs
    them (the fused cross-entropy) then stays a call in the compiled graph."""
    return torch.compiler.is_compiling() and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


_CACHE: Dict[str, object] = {}
# The Triton interpreter keeps its state in the triton.language module, so two threads
# interpreting kernels at once break each other (fxmegatron.verify runs ranks as threads):
# interpreted launches take turns. Compiled kernels are launched freely.
_INTERPRETER_LOCK = threading.Lock()
_COMPILE_LOCK = threading.Lock()


class _Serialised:
    """An interpreted kernel whose launches hold ``_INTERPRETER_LOCK``."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return launch(*args, **kwargs)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def compile_source(src: str, name: str):
    """The jitted kernel ``name`` defined in ``src`` (cached by source)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    plain = interpret or torch.version.hip is not None
    key = hashlib.sha256((name + src + str(plain)).encode()).hexdigest()[:16]
    with _COMPILE_LOCK:     # threads of one process (verify's ranks) compile a kernel once
        if (key, interpret) not in _CACHE:
            _CACHE[(key, interpret)] = _load(src, name, key, plain, interpret)
        return _CACHE[(key, interpret)]


def _load(src: str, name: str, key: str, plain: bool, interpret: bool):
    folder = os.path.join(tempfile.gettempdir(), "fxmegatron_kernels")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"k_{key}.py")
    # triton.jit reads the source of the function from its file; several processes may write
    # the same kernel at once, so each writes its own file and renames it into place
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        f.write(f"import triton\nimport triton.language as tl\n\n_PLAIN_MATH = tl.constexpr({plain})\n\n\n" + src)
    os.replace(part, path)
    spec = importlib.util.spec_from_file_location(f"fxmegatron_kernel_{key}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernel = getattr(mod, name)
    return _Serialised(kernel) if interpret else kernel


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tiles(n: int, backward: bool, row_grad: bool = False, flat: bool = False,
          bcast: bool = False, rotated: bool = False) -> Tuple[int, int, int]:
    """(BM, BN, num_warps) for an [M, n] output, from sweeps on an H200
    (``benchmarks/fused_kernels.py --sweep``). ``flat``: a chain of full-shape inputs only,
    run as one row of all its elements. A forward with a row input (a bias) takes wide
    tiles (up to 1024 columns, 4 warps); one with a broadcast input (a mask) runs of up to
    1024 contiguous elements, both passes; rotary's, 128 columns by 16 rows (the partner
    load), both passes. A backward that sums
    a bias gradient takes tall narrow tiles (fewer row partials). Fixed, not timed at run
    time: every tp rank must sum a replicated bias's gradient in the same order. A flat
    forward takes 512 elements over 2 warps (SiLU·mul, Llama shapes, five rounds: 0.3246 ms
    against 0.3264 for 2048 over 4 warps and torch.compile's 0.3251)."""
    if flat:
        return (1, 2048, 4) if backward else (1, 512, 2)
    if backward and row_grad:
        bn = min(_pow2(n), 64)
        return max(1, 4096 // bn), bn, 4
    if bcast and not rotated:
        # contiguous runs of up to 1024 elements: scale+mask at gpt1.3b, 1024 columns of one row
        # (0.509 / 0.512 ms) against 32 rows of 128 (0.512 / 0.514), forward / backward
        bn = min(_pow2(n), 1024)
        return max(1, 1024 // bn), bn, 2 if backward else 4
    if backward or bcast:
        bn = min(_pow2(n), 128)
        return max(1, (2048 if rotated else 4096) // bn), bn, 8
    bn = min(_pow2(n), 1024)
    return (max(1, 4096 // bn), bn, 4) if bn >= 512 else (max(1, 2048 // bn), bn, 8)


class FusedChain:
    """Runs a ``Chain`` as two generated kernels; ``apply`` is differentiable.

    ``shapes`` (the inputs' shapes, optional) fixes the layout that ``fwd_src``/``bwd_src``
    show; calls generate (and cache) the source of the layout they meet."""

    def __init__(self, chain: Chain, kinds: Sequence[str], shapes: Optional[Sequence[Tuple[int, ...]]] = None):
        self.chain, self.kinds = chain, list(kinds)
        self.fwd_tiles: Optional[Tuple[int, int, int]] = None     # overrides of ``tiles`` (benchmarks)
        self.bwd_tiles: Optional[Tuple[int, int, int]] = None
        self.keep_reused = True       # False: no eviction hints (benchmarks compare)
        self._src: Dict[tuple, str] = {}
        self._plans: Dict[tuple, tuple] = {}
        # input i whose gradient is exactly incoming gradient j
        self._passed = {i: chain.grad_outputs.index(e) for i, e in enumerate(chain.grads)
                        if e in chain.grad_outputs and i not in chain.rotated}
        q4 = bool(chain.dropouts)     # the dump shows the common, aligned case
        self._example = self._layout(shapes, q4) if shapes is not None else None
        if self._example is None and BCAST not in self.kinds and not self._sharded_dropout():
            self._example = Layout((1,), tuple(None for _ in self.kinds), False, q4)

    def _sharded_dropout(self) -> bool:
        return any(d.shard_dim >= 0 for d in self.chain.dropouts)

    def _layout(self, shapes, q4: bool = False) -> Layout:
        full = next(tuple(s) for s, k in zip(shapes, self.kinds) if k == FULL)
        pad = tuple((1,) * (len(full) - len(s)) + tuple(s) if k == BCAST else None
                    for s, k in zip(shapes, self.kinds))
        # shape only matters to the source through broadcast offsets and sharded dropout
        shape = full if (BCAST in self.kinds or self._sharded_dropout()) else (1,)
        return Layout(shape, pad, math.prod(full) >= 2 ** 31, q4, self.keep_reused)

    @property
    def flat(self) -> bool:
        """Full-shape inputs only: the kernels see one row of all the elements."""
        return all(k in (FULL, KEY) for k in self.kinds) and not self.chain.rotated

    def _view(self, full: torch.Tensor) -> Tuple[int, int]:
        if self.flat:
            return 1, full.numel()
        n = full.shape[-1]
        return full.numel() // max(n, 1), n

    def _quarter(self, full: torch.Tensor, n: int, bn: int) -> bool:
        """Whether each aligned group of four columns holds four consecutive indices of every
        dropout's unsplit tensor, starting at a multiple of four (see ``_Emitter._random_words``)."""
        if not self.chain.dropouts or n % 4 or bn % 4:
            return False
        for d in self.chain.dropouts:
            if d.shard_dim >= 0:
                inner = math.prod(full.shape[d.shard_dim + 1:])
                if (full.shape[d.shard_dim] * inner) % 4 or (d.global_shape[d.shard_dim] * inner) % 4 \
                        or (d.start * inner) % 4:
                    return False
        return True

    def _launch(self, xs, backward: bool):
        """(m, n, layout, (BM, BN, warps), row blocks, column blocks) of a call."""
        import triton
        full = self._full(xs)
        m, n = self._view(full)
        cfg = (self.bwd_tiles if backward else self.fwd_tiles) or \
            tiles(n, backward, ROW in self.kinds, self.flat, BCAST in self.kinds, bool(self.chain.rotated))
        layout = self._layout([tuple(x.shape) for x in xs], self._quarter(full, n, cfg[1]))
        return m, n, layout, cfg, triton.cdiv(m, cfg[0]), triton.cdiv(n, cfg[1])

    def source(self, layout: Layout, backward: bool, needs: Optional[Tuple[bool, ...]] = None) -> str:
        key = (layout, backward, needs)
        if key not in self._src:
            self._src[key] = backward_source(self.chain, self.kinds, "bwd", layout, needs) if backward \
                else forward_source(self.chain, self.kinds, "fwd", layout)
        return self._src[key]

    @property
    def fwd_src(self) -> str:
        return self.source(self._example, False) if self._example else "# generated per call (broadcast inputs)"

    @property
    def bwd_src(self) -> str:
        return self.source(self._example, True) if self._example else "# generated per call (broadcast inputs)"

    def _full(self, xs):
        return next(x for x, k in zip(xs, self.kinds) if k == FULL)

    def _out_dtype(self, xs):
        fulls = [x for x, k in zip(xs, self.kinds) if k in (FULL, ROW, BCAST) and x.is_floating_point()]
        return fulls[0].dtype

    def _plan(self, xs, backward: bool, needs=None):
        """(kernel, grid, m, n, NB, tiles, row blocks) of a call, cached by the inputs' shapes
        and dtypes: a call then costs a dict look-up and a launch (these kernels run in tens
        of microseconds, so host time shows)."""
        key = (tuple((x.shape, x.dtype, x.device) for x in xs), backward, needs, self.fwd_tiles, self.bwd_tiles,
               self.keep_reused)
        plan = self._plans.get(key)
        if plan is None:
            m, n, layout, cfg, mb, nb = self._launch(xs, backward)
            kernel = compile_source(self.source(layout, backward, needs if backward else None),
                                    "bwd" if backward else "fwd")
            plan = self._plans[key] = (kernel, (mb * nb,), m, n, nb, cfg, mb)
        return plan

    def forward(self, *xs: torch.Tensor) -> List[torch.Tensor]:
        full = self._full(xs)
        kernel, grid, m, n, nb, (bm, bn, warps), _ = self._plan(xs, False)
        outs = [torch.empty(full.shape, dtype=self._out_dtype(xs), device=full.device)
                for _ in self.chain.outputs]
        kernel[grid](*[x.contiguous() for x in xs], *outs, m, n, nb, BM=bm, BN=bn, num_warps=warps)
        return outs

    def backward(self, xs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
                 needs: Optional[Sequence[bool]] = None) -> List[Optional[torch.Tensor]]:
        full = self._full(xs)
        needs = tuple(bool(w) and k != KEY for w, k in zip(needs or [True] * len(xs), self.kinds))
        # a gradient that is an incoming gradient as it is (a residual add) is that tensor
        passed = {i: self._passed[i] for i in range(len(xs))
                  if needs[i] and i in self._passed and xs[i].shape == full.shape
                  and gs[self._passed[i]].dtype == xs[i].dtype}
        needs = tuple(w and i not in passed for i, w in enumerate(needs))
        kernel, grid, m, n, nb, (bm, bn, warps), blocks = self._plan(xs, True, needs)
        dxs = {}
        for i, (x, k) in enumerate(zip(xs, self.kinds)):
            if k == KEY or not needs[i]:
                continue
            if k == FULL:
                dxs[i] = torch.empty(full.shape, dtype=x.dtype, device=full.device)
            elif k == ROW:      # one fp32 partial sum per row block
                dxs[i] = torch.empty((blocks, n), dtype=torch.float32, device=full.device)
            else:
                dxs[i] = torch.empty(full.shape, dtype=torch.float32, device=full.device)
        if any(needs):
            # inputs whose gradient is not asked for still take a (never written) pointer slot
            slots = [dxs.get(i, full) for i, k in enumerate(self.kinds) if k != KEY]
            kernel[grid](*[x.contiguous() for x in xs], *[g.contiguous() for g in gs],
                         *slots, m, n, nb, BM=bm, BN=bn, num_warps=warps)
        for i, j in passed.items():
            dxs[i] = gs[j]
        out: List[Optional[torch.Tensor]] = []
        for i, (x, k) in enumerate(zip(xs, self.kinds)):
            if i not in dxs:
                out.append(None)
            elif k == ROW:
                out.append(dxs[i].sum(0).reshape(x.shape).to(x.dtype))
            elif k == BCAST:
                out.append(dxs[i].sum_to_size(x.shape).to(x.dtype))
            else:
                out.append(dxs[i])
        return out

    def apply(self, *xs: torch.Tensor):
        return _FusedFn.apply(self, *xs)


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused: FusedChain, *xs):
        ctx.fused = fused
        ctx.save_for_backward(*xs)       # the chain's inputs only: the chain is recomputed in backward
        outs = fused.forward(*xs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        full = ctx.fused._full(ctx.saved_tensors)
        gs = [g if g is not None else torch.zeros(full.shape, dtype=full.dtype, device=full.device) for g in gs]
        return (None,) + tuple(ctx.fused.backward(ctx.saved_tensors, gs, ctx.needs_input_grad[1:]))
