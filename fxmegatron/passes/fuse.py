"""Fuse runs of elementwise ATen ops into one generated Triton kernel each.

A group is a run of elementwise nodes in graph order, each using a value of the
run, all producing the run's shape. Its tensor inputs are of that shape ("full"),
broadcast along the last dim ("row", a bias), broadcast otherwise ("bcast": rotary
cos/sin, attention masks), or a dropout key. Nodes outside the group may sit
between members as long as none of them uses a member, so every member used later
can be an output of the fused call placed at the run's last member.

Besides ATen elementwise ops a group may hold counter-based dropout
(``fxmegatron.ops.dropout``; the kernel draws the same mask with ``tl.rand``), ``where`` /
``masked_fill``, and the rotary embedding's ``cat(-x2, x1)``, which is first
rewritten to ``rotate_half(x)`` so that it reads one input.

Each group becomes a ``Fused`` submodule. On CUDA tensors (or under
``TRITON_INTERPRET=1``) it runs the generated forward kernel, and in backward a
kernel that recomputes the chain from the group's inputs. Under torch.compile
(``parallelize(fuse=True, compile=True)``) it is one call of the custom op
``fxmegatron::fused_forward`` (``fxmegatron.codegen.fused_op``), which runs the same
kernels, so that dynamo neither breaks the graph at it nor traces into it and inductor
compiles the rest. Elsewhere, and in eval mode, it runs the original ATen ops, kept as
a GraphModule. The dump writes each group's Triton source.
"""
from __future__ import annotations

import math
from typing import List

import torch
import torch.fx as fx
import torch.nn as nn

from fxmegatron.codegen.chain_source import BCAST, FULL, KEY, ROW
from fxmegatron.codegen.expr import rotate_half
from fxmegatron.codegen.fused_chain import FusedChain
from fxmegatron.codegen.fused_op import chain_id, fused_forward
from fxmegatron.codegen.lower import ELEMENTWISE, lower_nodes
from fxmegatron.codegen.where_kernels_run import kernels_in_compiled_graph, kernels_run
from fxmegatron.ops.dropout import counter_dropout, dropout_off, rng_key
from fxmegatron.passes.outline import boundary, outline

aten = torch.ops.aten


class Fused(nn.Module):
    """One fused elementwise group: generated kernels, with the ATen ops as the fallback."""

    def __init__(self, fallback: fx.GraphModule, chain, kinds, label: str, shapes=None):
        super().__init__()
        self.fallback = fallback
        self.kinds = list(kinds)
        self.label = label
        self.kernel = FusedChain(chain, kinds, shapes)
        self.chain_id = chain_id(self.kernel)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.chain_id = chain_id(self.kernel)       # a copy (deepcopy) has a chain of its own

    def forward(self, *xs):
        # eval mode: the fallback's dropouts read the key and do nothing; the kernel would draw
        if any(k == KEY and dropout_off(x) for k, x in zip(self.kinds, xs)):
            return self.fallback(*xs)
        if kernels_run(xs[0]):
            out = self.kernel.apply(*xs)
            return out if isinstance(out, tuple) else (out,)
        if kernels_in_compiled_graph(xs[0]):        # one opaque call for dynamo, our kernels in it
            return tuple(fused_forward(list(xs), self.chain_id))
        return self.fallback(*xs)

    def source(self) -> str:
        return f"# {self.label}\n# inputs: {self.kinds}\n\n{self.kernel.fwd_src}\n\n{self.kernel.bwd_src}"


def _pk(n):
    return getattr(n.target, "overloadpacket", None)


def _shape(n):
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _kind(inp: fx.Node, shape) -> str:
    if inp.op == "call_function" and inp.target is rng_key:
        return KEY
    v = inp.meta.get("val")
    if not isinstance(v, torch.Tensor) or not (v.is_floating_point() or v.dtype == torch.bool):
        return ""
    s = tuple(v.shape)
    if s == shape:
        return FULL
    if len(s) >= 1 and s[-1] == shape[-1] and all(d == 1 for d in s[:-1]) and v.is_floating_point():
        return ROW
    if 1 <= len(s) <= len(shape) and all(a in (1, b) for a, b in zip(s[::-1], shape[::-1])):
        return BCAST
    return ""


def _dropout_fusible(n: fx.Node) -> bool:
    """Counter-based dropout whose element indices the kernel can form: unsplit or one slice,
    and fewer than 2**32 elements (the Philox counter's low word)."""
    p, train, gshape = n.args[1], n.args[2], n.args[5]
    slices = n.args[7] if len(n.args) > 7 else ()
    return bool(train) and 0.0 < p < 1.0 and len(slices) <= 1 and math.prod(gshape) < 2 ** 32


def _fusible(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is counter_dropout:
        ok = _dropout_fusible(n)
    elif n.target is rotate_half:
        ok = True
    elif _pk(n) in ELEMENTWISE:
        ok = not (set(n.kwargs) - {"alpha", "approximate"})      # e.g. div's rounding_mode: not this kind
        ok = ok and all(isinstance(a, (fx.Node, int, float, str, bool)) for a in n.args)
    else:
        return False
    v = n.meta.get("val")
    return ok and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1


def _slice_of(n):
    """(source, start, end) of ``aten.slice(x, -1, start, end)`` over the last dim, else None."""
    if n.op != "call_function" or n.target is not aten.slice.Tensor or len(n.args) < 4:
        return None
    if len(n.args) > 4 and n.args[4] != 1:      # a strided slice is not half of a rotation
        return None
    src = n.args[0]
    v = src.meta.get("val")
    if not isinstance(v, torch.Tensor) or n.args[1] not in (-1, v.dim() - 1):
        return None
    end = min(n.args[3], v.shape[-1])
    return src, n.args[2], end


def _rewrite_rotations(gm: fx.GraphModule) -> None:
    """``cat([-x[..., h:], x[..., :h]], -1)`` -> ``rotate_half(x)``: one elementwise-like node
    reading ``x`` (the kernel loads x at the partner column); the slices die with the cat."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.cat.default or len(n.args[0]) != 2:
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or (len(n.args) > 1 and n.args[1] not in (-1, v.dim() - 1)):
            continue
        neg, second = n.args[0]
        if neg.op != "call_function" or neg.target is not aten.neg.default:
            continue
        a, b = _slice_of(neg.args[0]), _slice_of(second)
        d = v.shape[-1]
        if not a or not b or a[0] is not b[0] or d % 2 or tuple(a[0].meta["val"].shape) != tuple(v.shape):
            continue
        if (a[1], a[2], b[1], b[2]) != (d // 2, d, 0, d // 2):
            continue
        with gm.graph.inserting_before(n):
            rot = gm.graph.call_function(rotate_half, (a[0],))
        rot.meta = dict(n.meta)
        n.replace_all_uses_with(rot)
        gm.graph.erase_node(n)
        for dead in (neg, neg.args[0], second):
            if not dead.users:
                gm.graph.erase_node(dead)


def _split_biases(gm: fx.GraphModule) -> None:
    """``linear(x, w, b)`` read only by a fusible op of ``LONE_GROUPS`` -> ``linear(x, w) + b``:
    the bias add joins that op's group, whose backward sums the bias's gradient in its pass
    over the output gradient. Left in the linear, cuBLAS adds the bias for free, but the
    bias's gradient is a pass of its own (inductor's, re-reading the output gradient: 1.5 ms a
    step on gpt1.3b, one H200)."""
    for n in list(gm.graph.nodes):
        if (n.op != "call_function" or n.target is not aten.linear.default or len(n.args) != 3
                or not isinstance(n.args[2], fx.Node) or len(n.users) != 1):
            continue
        user = next(iter(n.users))
        if user.target not in LONE_GROUPS or not _fusible(user):
            continue
        with gm.graph.inserting_after(n):
            mm = gm.graph.call_function(aten.linear.default, n.args[:2])
        with gm.graph.inserting_after(mm):
            add = gm.graph.call_function(aten.add.Tensor, (mm, n.args[2]))
        mm.meta, add.meta = dict(n.meta), dict(n.meta)
        n.replace_all_uses_with(add)
        gm.graph.erase_node(n)


def _groups(gm: fx.GraphModule) -> List[List[fx.Node]]:
    """Connected elementwise nodes of one shape, each group in graph order. Unrelated nodes may
    sit between members (SwiGLU's up-projection between silu and mul), and two open groups
    merge at a node that reads both (rotary: ``q*cos`` and ``rotate_half(q)*sin`` at their add).
    A node that uses a member without joining ends that group, since the fused call is placed
    at the group's last member. A lone node is a group when it is in ``LONE_GROUPS``."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    owner = {}          # node -> its open group (a list shared by all members)
    done: List[List[fx.Node]] = []

    def close(g):
        for m in g:
            owner.pop(m, None)
        if len(g) >= 2 or g[0].target in LONE_GROUPS:
            done.append(g)

    for n in gm.graph.nodes:
        ins = n.all_input_nodes
        touched = []
        for a in ins:
            g = owner.get(a)
            if g is not None and all(g is not t for t in touched):
                touched.append(g)
        if _fusible(n) and touched:
            shape = _shape(n)
            if (all(_shape(g[0]) == shape for g in touched)
                    and all(a in owner or _kind(a, shape) for a in ins)):
                group = sorted([m for g in touched for m in g], key=order.__getitem__) + [n]
                for m in group:
                    owner[m] = group
                continue
        for g in touched:
            close(g)
        if n.op == "output":
            for g in {id(g): g for g in owner.values()}.values():
                close(g)
        elif _fusible(n) and all(_kind(a, _shape(n)) for a in ins):
            owner[n] = [n]
    return sorted(done, key=lambda g: order[g[-1]])


def _name(n: fx.Node) -> str:
    pk = _pk(n)
    return str(pk.__name__) if pk is not None else n.target.__name__


def _rewrite(gm: fx.GraphModule, group: List[fx.Node], index: int) -> None:
    shape = _shape(group[0])
    inputs, outputs = boundary(group)
    if not any(_kind(a, shape) == FULL for a in inputs):
        return      # the kernel's grid follows a full-shape input
    rotated = [n.args[0] for n in group if n.target is rotate_half]
    if any(_kind(x, shape) != FULL for x in rotated):
        return      # a rotation reads its input at the partner column: it must be an input of full shape
    chain = lower_nodes(group, inputs, outputs)
    label = " -> ".join(_name(n) for n in group)
    kinds = [_kind(a, shape) for a in inputs]
    shapes = [tuple(a.meta["val"].shape) for a in inputs]
    outline(gm, group, f"fused_{index}", lambda body, i, o: Fused(body, chain, kinds, label, shapes),
            {"fused": label})


# A group of one of these alone still pays: dropout's kernel draws the mask; GeLU's computes
# tanh/erf in fewer instructions than inductor's libdevice call, which leaves a GeLU after a
# biased linear (bias in cuBLAS's epilogue) bound by instructions (gpt1.3b, one H200: 0.193 ms
# for 512 MB, 2.7 TB/s).
LONE_GROUPS = {counter_dropout, aten.gelu.default}

# Where a generated kernel beat inductor's on the same chain (docs/PERFORMANCE.md, fused-kernels-h200: "Generated
# elementwise kernels vs eager and torch.compile", one H200, 2026-11-21, fwd+bwd): beside
# inductor only groups holding one of these ops are kept; inductor fuses the rest with its
# neighbours (a norm's reduction, a matmul's epilogue), which a group boundary would stop.
# SiLU·mul (0.999×), scale+mask (0.996×) and plain adds tie or lose: left to inductor.
WINS_OVER_INDUCTOR = {
    aten.gelu.default: "bias+GeLU 1.27× (tanh), 1.39× (erf)",
    counter_dropout: "bias+dropout+residual 1.51×",
    rotate_half: "rotary 1.38×",
}


def apply_fuse(gm: fx.GraphModule, beside_inductor: bool = False) -> fx.GraphModule:
    """Fuse every elementwise run of ``gm`` and of its recomputed regions; in place.
    ``beside_inductor`` (``compile=True``): only the runs with an op of
    ``WINS_OVER_INDUCTOR``; inductor generates the others."""
    from fxmegatron.passes.recompute import Recomputed

    for mod in list(gm.modules()):
        if isinstance(mod, Recomputed):
            apply_fuse(mod.body, beside_inductor)
    _rewrite_rotations(gm)
    _split_biases(gm)
    count = sum(1 for _ in gm.named_children() if _[0].startswith("fused_"))
    for i, group in enumerate(_groups(gm)):
        if beside_inductor and not any(n.target in WINS_OVER_INDUCTOR for n in group):
            continue
        _rewrite(gm, group, count + i)
    gm.graph.lint()
    gm.recompile()
    return gm
