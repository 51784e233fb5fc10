"""Matmuls: column- and row-parallel linears (Megatron 2019), however spelled
(``linear``, ``addmm``, ``mm``, ``matmul``, ``einsum``; the weight possibly transposed),
grouped matmuls of experts, and matmuls of activations."""
from __future__ import annotations

import torch
import torch.fx as fx

from fxmegatron.passes.tensor_parallel.nodes import arg, norm, packet, val, where
from fxmegatron.passes.tensor_parallel.plan import F, GATHER, GATHER_INTO_COLUMN, Decision
from fxmegatron.passes.tensor_parallel.rules.opaque import replicate_all
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.passes.tensor_parallel.sequence import SEQ, gather
from fxmegatron.placement import Partial, R, Replicate, Shard

aten = torch.ops.aten


@register(aten.linear, aten.addmm, aten.mm, aten.matmul, aten.bmm)
def matmul(view, node):
    """``linear(x, W, b)``, ``addmm(b, x, W)``, ``mm(x, W)``, ``matmul(x, W)``: with a 2-D
    parameter ``W`` (a transpose of it included: the dim map says which dim is which)
    this is a linear (see ``linear``); otherwise a matmul of activations
    (``activation_matmul``). addmm with alpha/beta runs replicated."""
    pk = packet(node)
    args = node.args
    if pk is aten.linear:
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else node.kwargs.get("bias")
        w_out, w_in = 0, 1
    elif pk is aten.addmm:
        b, x, w = args[0], args[1], args[2]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return replicate_all(view, node, "is an addmm with alpha/beta")
        w_out, w_in = 1, 0
    else:
        x, w, b = args[0], args[1], None
        w_out, w_in = 1, 0
    if pk is aten.bmm and _experts_bmm(view, x, w):
        return linear(view, node, x, w, None, 2, 1, 2, 2)
    if w not in view.free or val(w) is None or val(w).ndim != 2:
        return activation_matmul(view, node, x, w)
    return linear(view, node, x, w, b, w_out, w_in, val(x).ndim - 1, val(node).ndim - 1)


def _experts_bmm(view, x, w) -> bool:
    """``bmm(x [E, T, in], W [E, in, out])`` with ``W`` a 3-D parameter (a transpose of its last
    two dims included), its experts dim first: each expert's rows meet its own matrix (Llama 4's
    experts), so it is a linear along ``in`` -> ``out`` for every expert at once, as
    ``grouped_mm`` is. Precondition: ``x`` not split along the experts dim."""
    if w not in view.free or val(w) is None or val(w).ndim != 3 or view.free[w][1][0] != 0:
        return False
    px = view.get(x)
    return not (isinstance(px, Shard) and norm(px.dim, 3) == 0)


def linear(view, node, x, w, b, w_out, w_in, x_in, out_dim):
    """``x`` times a 2-D parameter ``w`` whose dim ``w_in`` is contracted with dim ``x_in``
    of ``x`` and whose dim ``w_out`` becomes dim ``out_dim`` of the output.

    * row (``matmul.row``): ``x`` split along the contracted dim -> ``w`` split along
      ``w_in``, output a partial sum; a bias is added after the reduction.
    * column (``matmul.column``): ``x`` whole -> ``w`` (and bias) split along ``w_out``
      (in the fused blocks a later split asked for), output split along ``out_dim``; f on
      ``x``'s gradient. Precondition: tp divides the output features (and each block).
    * replicated (``matmul.replicated``), with the reason in its decision: tp does not
      divide the output features (or a block), the matmul was demoted, or ``w`` must
      stay replicated.
    ``x`` split along another dim demotes the matmuls it came from; a sequence shard is
    gathered; a partial ``x`` is reduced (g).
    """
    if isinstance(view.get(x), Partial):
        view.replicate(x, node)
    if isinstance(view.get(x), Shard) and SEQ in view.orig(x):
        gather(view, x, node, into_column=True)
    px = view.get(x)
    gathered_here = view.sees(GATHER_INTO_COLUMN, x, node)
    pname = view.free[w][0]
    at = f"{where(node)} (weight {pname})"
    if isinstance(px, Shard) and norm(px.dim, val(x).ndim) == x_in:
        if pname in view.forced_rep:
            view.demote(view.orig(x), node, f"is replicated: {view.forced_rep[pname]}")
        view.claim(w, Shard(w_in, px.blocks), at)
        if b is not None:   # added after the reduction: see pending_bias
            view.claim(b, R, at)
            view.defer_bias(b)
        view.decide(Decision("row"))
        return view.set(node, Partial(), rule="matmul.row")
    if isinstance(px, Shard):
        view.demote(view.orig(x), node, f"contracts dim {x_in}, not the split dim {px.dim}")
    reason = view.demoted.get(node) or view.forced_rep.get(pname)
    blocks = view.blocks_req.get(node)
    if reason is None:
        n_out = val(w).shape[w_out]
        for size in (blocks or (n_out,)):
            if size % view.tp:
                reason = (f"tp={view.tp} does not divide the {size} output features of {at}"
                          f"{' (one of its fused blocks ' + str(list(blocks)) + ')' if blocks else ''}: "
                          "a column-parallel matmul splits its output features evenly over tp ranks")
                break
    if reason is None:
        view.claim(w, Shard(w_out, blocks), at)
        if b is not None:
            view.claim(b, Shard(0, blocks), at)
        if x in view.needs_grad and not gathered_here:
            view.add(F, x, node)
        view.decide(Decision("column"))
        return view.set(node, Shard(out_dim, blocks), {node}, rule="matmul.column")
    if gathered_here:   # not column after all: its input gradient is whole
        view.move(GATHER_INTO_COLUMN, GATHER, x, node)
    view.claim(w, R, at)
    if b is not None:
        view.claim(b, R, at)
    view.decide(Decision("replicated", reason))
    return view.set(node, R, rule="matmul.replicated")



@register(aten._grouped_mm, "transformers::grouped_mm_fallback")
def grouped_mm(view, node):
    """The experts of a mixture: ``grouped_mm(x [S, in], W [E, in, out], offs)`` multiplies
    the rows of ``x`` routed to expert e (rows offs[e-1]..offs[e]) by ``W[e]``. Each row
    meets one expert's matrix, so row by row it is a linear, and ``linear``'s column and
    row splits hold with ``W`` split along ``out`` or ``in`` for every expert at once.
    Precondition: ``x`` 2-D, ``W`` a 3-D parameter (a transpose of it included), ``offs``
    given and, for ``aten._grouped_mm``, no bias and no output dtype; ``offs`` is made
    whole. Otherwise (2-D or 3-D ``x`` against a 2-D weight: groups along the contraction
    or batched) replicated with the reason."""
    x, w = node.args[0], node.args[1]
    offs = arg(node, 2, "offs")
    if (val(x) is None or val(x).ndim != 2 or w not in view.free or val(w) is None or val(w).ndim != 3
            or not isinstance(offs, fx.Node) or arg(node, 3, "bias") is not None
            or arg(node, 4, "out_dtype") is not None):
        why = ("is a grouped matmul other than the rows of a 2-D input by the 3-D expert weight parameter "
               "they are routed to, by offsets, without bias")
        view.decide(Decision("replicated", why))
        return replicate_all(view, node, why)
    view.replicate(offs, node)
    return linear(view, node, x, w, None, 2, 1, 1, 1)

def activation_matmul(view, node, x, w):
    """A matmul of two activations (attention scores, ...). Precondition: both whole, or
    both split along the same batch dim (heads), not a contracted or output row/column
    dim; otherwise the splits' matmuls are demoted."""
    for a in (x, w):
        if isinstance(view.get(a), Partial) or view.get(a) is None:
            view.replicate(a, node)
    px, pw = view.get(x), view.get(w)
    nd = val(node).ndim
    if isinstance(px, Replicate) and isinstance(pw, Replicate):
        return view.set(node, R, rule="matmul.activations")
    origins = view.orig(x) | view.orig(w)
    if isinstance(px, Shard) and isinstance(pw, Shard):
        dx = px.dim + nd - val(x).ndim
        dw = pw.dim + nd - val(w).ndim
        if dx == dw and dx < nd - 2 and px.blocks is None and pw.blocks is None:
            return view.set(node, Shard(dx), origins, rule="matmul.activations")
    view.demote(origins, node, "is a matmul of activations not split along the same batch dim")


def _einsum_spec(node):
    """(operand letters, output letters) of an einsum with an explicit output and no
    ellipsis or repeated letter in one operand; None otherwise."""
    eq = node.args[0].replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    ins, out = eq.split("->")
    specs = ins.split(",")
    if any(len(set(s)) != len(s) for s in specs + [out]) or len(specs) != len(node.args[1]):
        return None
    return specs, out


@register(aten.einsum)
def einsum(view, node):
    """``einsum(eq, [x, W])`` with a 2-D parameter ``W`` that has one letter only in the
    output (its output features) and one only in ``x`` (contracted), every other letter
    of ``x`` kept: a linear (``linear``: column or row). Otherwise an einsum of
    activations. Precondition there: all operands whole, or every operand holding one
    letter split along it (the output then split along it, or a partial sum where it is
    contracted); otherwise the splits' matmuls are demoted. Equations with ``...``, an
    implicit output or a repeated letter run replicated."""
    spec = _einsum_spec(node)
    if spec is None:
        return replicate_all(view, node, "is an einsum with '...', an implicit output or a diagonal")
    specs, out = spec
    ops = list(node.args[1])
    if len(ops) == 2:
        for wi in (0, 1):
            w, x = ops[wi], ops[1 - wi]
            ws, xs = specs[wi], specs[1 - wi]
            if w not in view.free or x in view.free or val(w) is None or val(w).ndim != 2:
                continue
            o = [c for c in ws if c in out and c not in xs]
            i = [c for c in ws if c in xs and c not in out]
            if len(o) == 1 and len(i) == 1 and set(out) == (set(xs) - set(i)) | set(o):
                return linear(view, node, x, w, None, ws.index(o[0]), ws.index(i[0]), xs.index(i[0]),
                              out.index(o[0]))
    return _activation_einsum(view, node, ops, specs, out)


def _activation_einsum(view, node, ops, specs, out):
    for a in ops:
        if isinstance(view.get(a), Partial) or view.get(a) is None:
            view.replicate(a, node)
    ps = [view.get(a) for a in ops]
    if all(isinstance(p, Replicate) for p in ps):
        return view.set(node, R, rule="matmul.einsum")
    origins = set().union(*(view.orig(a) for a in ops))
    letters = {(s[norm(p.dim, len(s))], p.blocks) for s, p in zip(specs, ps) if isinstance(p, Shard)}
    if len(letters) == 1:
        (c, blocks), = letters
        if blocks is None and all(isinstance(p, Shard) for s, p in zip(specs, ps) if c in s):
            plc = Shard(out.index(c)) if c in out else Partial()
            return view.set(node, plc, origins, rule="matmul.einsum")
    view.demote(origins, node, "is an einsum of activations not split along one letter of every operand "
                                "that has it")

