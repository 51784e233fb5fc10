"""Triton source for an elementwise chain (forward, and backward that recomputes the chain).

Inputs are either *full* (the output's shape) or *row* tensors broadcast along the
last dim (a bias of size N under an [M, N] activation). Loads are upcast to fp32,
the arithmetic is fp32, stores cast to the output's dtype. The backward saves only
the chain's inputs and recomputes the forward expressions it needs, so no
intermediate is ever stored. Kernels are cached by their source text.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from typing import Dict, List, Sequence, Tuple

import sympy as sp
import torch
from sympy.printing.str import StrPrinter

from .expr import Chain, Sigmoid

FULL, ROW = "full", "row"


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

    def _print_Function(self, e):
        if e.is_number:
            return repr(float(e))
        a = ", ".join(self._print(x) for x in e.args)
        if isinstance(e, Sigmoid):
            return f"tl.sigmoid({a})"
        name = type(e).__name__
        if name == "tanh":    # through the sigmoid: no overflow for large |x|
            return f"(2.0*tl.sigmoid(2.0*({a}))-1.0)"
        if name in ("exp", "erf", "log"):
            return f"tl.{name}({a})"
        raise NotImplementedError(f"no Triton form for {name}")

    def _print_exp(self, e):
        return f"tl.exp({self._print(e.args[0])})"


def _pr(e) -> str:
    return TritonPrinter().doprint(e)


def _loads(names: Sequence[str], kinds: Sequence[str]) -> List[str]:
    out = []
    for n, k in zip(names, kinds):
        idx = "offs % N" if k == ROW else "offs"
        out.append(f"    {n} = tl.load({n}_ptr + {idx}, mask=mask, other=0.0).to(tl.float32)")
    return out


def forward_source(chain: Chain, kinds: Sequence[str], name: str) -> str:
    xs = [str(s) for s in chain.inputs]
    outs = [f"y{i}" for i in range(len(chain.outputs))]
    lines = ["@triton.jit",
             f"def {name}({', '.join(x + '_ptr' for x in xs + outs)}, numel, N, BLOCK: tl.constexpr):",
             "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
             "    mask = offs < numel"]
    lines += _loads(xs, kinds)
    for o, e in zip(outs, chain.outputs):
        lines.append(f"    {o} = {_pr(e)}")
        lines.append(f"    tl.store({o}_ptr + offs, {o}.to({o}_ptr.dtype.element_ty), mask=mask)")
    return "\n".join(lines) + "\n"


def backward_source(chain: Chain, kinds: Sequence[str], name: str) -> str:
    """A 2-D kernel over [rows, N] tiles: full inputs' gradients are stored per element; a row
    input's gradient is summed over the tile's rows in the kernel (one fp32 partial per tile row
    block), so its full-size gradient is never written."""
    xs = [str(s) for s in chain.inputs]
    gs = [str(s) for s in chain.grad_outputs]
    dxs = [f"d{x}" for x in xs]
    shared, grads = chain.backward_cse()
    lines = ["@triton.jit",
             f"def {name}({', '.join(v + '_ptr' for v in xs + gs + dxs)}, M, N, BM: tl.constexpr, "
             "BN: tl.constexpr):",
             "    pm = tl.program_id(0)",
             "    cols1 = tl.program_id(1) * BN + tl.arange(0, BN)",
             "    rows = pm * BM + tl.arange(0, BM)[:, None]",
             "    cols = cols1[None, :]",
             "    mask = (rows < M) & (cols < N)",
             "    offs = rows * N + cols"]
    for v, k in zip(xs + gs, list(kinds) + [FULL] * len(gs)):
        if k == ROW:
            lines.append(f"    {v} = tl.load({v}_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)")
        else:
            lines.append(f"    {v} = tl.load({v}_ptr + offs, mask=mask, other=0.0).to(tl.float32)")
    full = xs[list(kinds).index(FULL)]
    for s_, e in shared:
        lines.append(f"    {s_} = {_pr(e)}")
    for d, e, k in zip(dxs, grads, kinds):
        lines.append(f"    {d} = {_pr(e)} + 0.0 * {full}")   # a tile even where the gradient is a constant
        if k == ROW:
            lines.append(f"    {d} = tl.sum(tl.where(mask, {d}, 0.0), axis=0)")
            lines.append(f"    tl.store({d}_ptr + pm * N + cols1, {d}, mask=cols1 < N)")
        else:
            lines.append(f"    tl.store({d}_ptr + offs, {d}.to({d}_ptr.dtype.element_ty), mask=mask)")
    return "\n".join(lines) + "\n"


_CACHE: Dict[str, object] = {}


def compile_source(src: str, name: str):
    """The jitted kernel ``name`` defined in ``src`` (cached by source)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    key = hashlib.sha256((name + src).encode()).hexdigest()[:16]
    if (key, interpret) in _CACHE:
        return _CACHE[(key, interpret)]
    folder = os.path.join(tempfile.gettempdir(), "fxmegatron_kernels")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"k_{key}.py")
    # triton.jit reads the source of the function from its file; several processes may write
    # the same kernel at once, so each writes its own file and renames it into place
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n\n" + src)
    os.replace(part, path)
    spec = importlib.util.spec_from_file_location(f"fxmegatron_kernel_{key}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernel = getattr(mod, name)
    _CACHE[(key, interpret)] = kernel
    return kernel


class FusedChain:
    """Runs a ``Chain`` as two generated kernels; ``apply`` is differentiable."""

    def __init__(self, chain: Chain, kinds: Sequence[str], block: int = 1024):
        self.chain, self.kinds, self.block = chain, list(kinds), block
        self.fwd_src = forward_source(chain, kinds, "fwd")
        self.bwd_src = backward_source(chain, kinds, "bwd")

    def _launch(self, src, name, args, numel, n):
        import triton
        kernel = compile_source(src, name)
        kernel[(triton.cdiv(numel, self.block),)](*args, numel, n, BLOCK=self.block)

    def forward(self, *xs: torch.Tensor) -> List[torch.Tensor]:
        full = next(x for x, k in zip(xs, self.kinds) if k == FULL)
        outs = [torch.empty_like(full) for _ in self.chain.outputs]
        self._launch(self.fwd_src, "fwd", [x.contiguous() for x in xs] + outs, full.numel(), full.shape[-1])
        return outs

    def backward(self, xs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        import triton
        full = next(x for x, k in zip(xs, self.kinds) if k == FULL)
        n = full.shape[-1]
        m = full.numel() // n
        bm, bn = 16, 128
        blocks = triton.cdiv(m, bm)
        # full inputs: gradients in their dtype; row inputs: one fp32 partial sum per row block
        dxs = [torch.empty(full.shape, dtype=x.dtype, device=full.device) if k == FULL
               else torch.empty((blocks, n), dtype=torch.float32, device=full.device)
               for x, k in zip(xs, self.kinds)]
        kernel = compile_source(self.bwd_src, "bwd")
        kernel[(blocks, triton.cdiv(n, bn))](*[x.contiguous() for x in xs], *[g.contiguous() for g in gs], *dxs,
                                            m, n, BM=bm, BN=bn)
        out = []
        for d, x, k in zip(dxs, xs, self.kinds):
            out.append((d.sum(0).reshape(x.shape) if k == ROW else d).to(x.dtype))
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
        return (None,) + tuple(ctx.fused.backward(ctx.saved_tensors, gs))
