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
with respect to the rotated value, evaluated at the partner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import sympy as sp

from fxmegatron.codegen.expr import Chain
from fxmegatron.codegen.triton_printer import fold_one_plus_erf, triton_expr, with_helpers

FULL, ROW, BCAST, KEY = "full", "row", "bcast", "key"
_UNIFORM_SCALE = 4.6566127342e-10      # triton.language.random.uint_to_uniform_float, 32-bit


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
        em.add(f"{o} = {triton_expr(fold_one_plus_erf(e))}")
        em.add(f"tl.store({o}_ptr + offs, {o}.to({o}_ptr.dtype.element_ty), mask=mask)")
    return with_helpers("\n".join(head + em.lines) + "\n")


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
        em.add(f"{s_} = {triton_expr(e)}")
    val = dict(zip(want, red[:len(want)]))
    rval = dict(zip(rot, red[len(want):]))
    for i in want:
        d, k = f"d{em.xs[i]}", kinds[i]
        if val[i].free_symbols:
            em.add(f"{d} = {triton_expr(val[i])}")
        else:    # a constant gradient still fills a tile
            em.add(f"{d} = tl.zeros([BM, BN], dtype=tl.float32) + {triton_expr(val[i])}")
        if i in rval:    # the transposed rotation: -rotate_half of the rotated value's gradient
            em.add(f"{d} = {d} - sgn * ({triton_expr(rval[i])})")
        if k == ROW:
            em.add(f"{d} = tl.sum(tl.where(mask, {d}, 0.0), axis=0)")
            em.add(f"tl.store({d}_ptr + pm * N + cols1, {d}, mask=cols1 < N)")
        else:
            em.add(f"tl.store({d}_ptr + offs, {d}.to({d}_ptr.dtype.element_ty), mask=mask)")
    return with_helpers("\n".join(head + em.lines) + "\n")
