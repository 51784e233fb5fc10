"""Views and layout ops: view/reshape, flatten, transpose/permute/unsqueeze/squeeze/expand,
split/chunk, and getitem of their tuple results."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.errors import ShardingError
from fxmegatron.passes.tensor_parallel.nodes import norm, packet, val, where
from fxmegatron.passes.tensor_parallel.rules.opaque import replicate_all
from fxmegatron.passes.tensor_parallel.rules.registry import register
from fxmegatron.passes.tensor_parallel.sequence import SEQ, gather
from fxmegatron.placement import Partial, R, Shard

aten = torch.ops.aten

def view_groups(ins, outs):
    """Pair up dims of a view: [(in_dims, out_dims)] with equal products."""
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, gj = [], []
        pi = pj = 1
        if i < len(ins):
            gi.append(i); pi = ins[i]; i += 1
        if j < len(outs):
            gj.append(j); pj = outs[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(ins):
                gi.append(i); pi *= ins[i]; i += 1
            elif j < len(outs):
                gj.append(j); pj *= outs[j]; j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


@register(operator.getitem)
def getitem(view, node):
    """An element of a tuple result (split, native_dropout, ...): that element's placement."""
    src = view.get(node.args[0])
    return view.set(node, src[node.args[1]] if isinstance(src, tuple) else R, view.orig(node.args[0]))


def _unit_dims_alias(view, node, x, sizes):
    """A reshape or expand of a parameter no rule has claimed that only adds, drops or
    broadcasts dims of size 1 (gpt-oss's ``sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)``):
    the parameter's dims keep their order and their sizes are given as -1, so the same call on
    a shard gives the shard's view. The output stays free with the new dims mapped to no
    parameter dim; otherwise None."""
    pname, dmap = view.free[x]
    ins, outs = list(val(x).shape), list(val(node).shape)
    kept_in = [i for i, n in enumerate(ins) if n != 1]
    kept_out = [j for j, n in enumerate(outs) if n != 1 and (packet(node) is not aten.expand
                                                             or j - (len(outs) - len(ins)) in kept_in)]
    if [ins[i] for i in kept_in] != [outs[j] for j in kept_out] or any(sizes[j] != -1 for j in kept_out):
        return None
    out_map = [None] * len(outs)
    for i, j in zip(kept_in, kept_out):
        out_map[j] = dmap[i]
    return view.alias(pname, tuple(out_map))


def _unsplit_input(view, node, x, p):
    """A reshape of a value that is not split: of an unclaimed parameter, an alias when it
    only moves unit dims (``_unit_dims_alias``), else replicated; a partial sum stays partial
    (with its deferred bias where the last dim is kept), anything else carried."""
    if p is None:
        return _unit_dims_alias(view, node, x, list(node.args[1])) or replicate_all(view, node, "")
    if isinstance(p, Partial):
        return view.set(node, p if view.carry_bias(x, node) else R)
    return view.set(node, p)


@register(aten.view, aten.reshape, aten._unsafe_view)
def view(view, node):
    """Reshapes keeping the split on the dim it lands in (e.g. [b, s, h*d] -> [b, s, h, d]:
    the heads dim). Precondition: the split dim is the first non-unit dim of its group of
    merged/split dims, tp divides the size it lands in, and it is not made of fused blocks
    that the view regroups. The size argument is divided by tp (``floordiv`` where
    symbolic). A sequence shard whose sequence is merged is gathered first.
    Failing: a merge into a later position or of fused blocks demotes the split's matmuls,
    and so does a landing dim smaller than tp that divides it (fewer kv heads than tp:
    they are computed whole on every rank); another size tp does not divide (heads, kv
    heads) raises a ShardingError naming the matmuls that produced it. A partial sum
    stays partial (with its deferred bias)."""
    x = node.args[0]
    p = view.get(x)
    if not isinstance(p, Shard):
        return _unsplit_input(view, node, x, p)
    ins = list(val(x).shape)
    outs = list(val(node).shape)
    d = norm(p.dim, len(ins))
    origins = view.orig(x)
    for gi, gj in view_groups(ins, outs):
        if d not in gi:
            continue
        gi_big = [i for i in gi if ins[i] != 1]
        gj_big = [j for j in gj if outs[j] != 1]
        if SEQ in origins and (len(gi_big) > 1 or len(gj_big) > 1):
            gather(view, x, node)      # e.g. [b, s, h] -> [b*s, h]: gather the sequence first
            return view.set(node, R)
        if not gj_big or gi_big[0] != d:
            view.demote(origins, node, f"merges split dim {d} of {ins} into a later position")
        e = gj_big[0]
        if len(gj_big) > 1 or len(gi_big) > 1:
            if p.blocks is not None:
                view.demote(origins, node, "reshapes a dim made of fused blocks")
        if outs[e] % view.tp and view.tp % outs[e] == 0:
            # fewer heads than ranks (kv heads): computed whole on every rank, and attention
            # gives each rank the ones its query heads use (attention.py)
            view.demote(origins, node, f"views its {outs[e]} heads (dim {e} of {ins} -> {outs}): fewer "
                                        f"than tp={view.tp}, so they are computed whole on every rank")
        if outs[e] % view.tp:
            owner = ", ".join(sorted(module_path(m) or m.name for m in origins))
            raise ShardingError(
                f"tp={view.tp} does not divide dim {e} (size {outs[e]}) of the view {ins} -> {outs} "
                f"at {where(node)}; that dim carries the split features of {owner} "
                "(for attention these are the heads or kv heads)")
        sizes = list(node.args[1])
        if isinstance(sizes[e], fx.Node):
            sizes[e] = ("floordiv", sizes[e])
        elif sizes[e] != -1:
            sizes[e] = sizes[e] // view.tp
        view.rewrite_args((x, sizes) + tuple(node.args[2:]))
        return view.set(node, Shard(e, p.blocks), origins)
    raise RuntimeError(f"internal: view dims not matched at {where(node)}")



@register(aten.flatten)
def flatten(view, node):
    """``flatten(x, start, end)`` merges dims start..end into one; it has no sizes to
    rewrite. A split dim outside them moves left with the merge. Inside them, the
    precondition is ``view``'s: the split dim is the first non-unit dim merged and is
    not made of fused blocks that the merge regroups (each rank's piece of the merged dim
    is then one contiguous block of it). Failing: a sequence shard is gathered first,
    another split demotes its matmuls. A partial sum stays partial (with its deferred
    bias while the last dim is kept). Overloads other than ``using_ints`` run replicated."""
    if node.target is not aten.flatten.using_ints:
        return replicate_all(view, node, f"is {node.target}, not flatten.using_ints")
    x = node.args[0]
    p = view.get(x)
    if not isinstance(p, Shard):
        return _unsplit_input(view, node, x, p)
    ins = list(val(x).shape)
    nd = len(ins)
    start = norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0), nd)
    end = norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1), nd)
    d = norm(p.dim, nd)
    origins = view.orig(x)
    if d < start:
        return view.set(node, p, origins)
    if d > end:
        return view.set(node, Shard(d - (end - start), p.blocks), origins)
    big = [i for i in range(start, end + 1) if ins[i] != 1]
    if len(big) > 1 and SEQ in origins:
        gather(view, x, node)      # e.g. [b, s, h] -> [b*s, h]: gather the sequence first
        return view.set(node, R)
    if big[0] != d:
        view.demote(origins, node, f"merges split dim {d} of {ins} into a later position")
    if len(big) > 1 and p.blocks is not None:
        view.demote(origins, node, "flattens a dim made of fused blocks")
    return view.set(node, Shard(start, p.blocks), origins)

def permutation(node, nd):
    """For an op that only reorders dims: out dim i is in dim perm[i] (None otherwise)."""
    pk = packet(node)
    dims = list(range(nd))
    if pk in (aten.t, aten.numpy_T):
        return dims[::-1] if pk is aten.numpy_T or nd == 2 else dims
    if pk in (aten.transpose, aten.swapaxes, aten.swapdims, aten.mT, aten.mH, aten.adjoint, aten.matrix_H):
        a, b = (norm(node.args[1], nd), norm(node.args[2], nd)) if len(node.args) > 2 else (nd - 2, nd - 1)
        dims[a], dims[b] = dims[b], dims[a]
        return dims
    if pk is aten.permute:
        return [norm(i, nd) for i in node.args[1]]
    return None


_PERMUTES = (aten.transpose, aten.t, aten.permute, aten.numpy_T, aten.swapaxes, aten.swapdims, aten.mT,
             aten.mH, aten.adjoint, aten.matrix_H)


@register(*_PERMUTES, aten.unsqueeze, aten.squeeze, aten.expand)
def layout(view, node):
    """Moves the split dim with the op (expand's size of the split dim divided by tp).
    Precondition: none beyond its input's. On a parameter no rule has claimed yet, a dim
    permutation (``W.T``, ``W.t()``, ``W.mT``, transpose, permute, ...) only remembers the
    dim map (the consumer claims the layout); other layout ops replicate it. A partial
    sum stays partial through permutations and unsqueeze/squeeze (with its deferred bias)
    and is reduced (g) before an expand."""
    pk = packet(node)
    x = node.args[0]
    p = view.get(x)
    nd_in = val(x).ndim
    perm = permutation(node, nd_in)
    if p is None:   # layout op on a parameter: still free, remember the dim map
        pname, dmap = view.free[x]
        if perm is not None:
            return view.alias(pname, tuple(dmap[i] for i in perm))
        if pk is aten.expand:
            return _unit_dims_alias(view, node, x, list(node.args[1])) or replicate_all(view, node, "")
        return replicate_all(view, node, "")
    if isinstance(p, Partial):
        if pk is not aten.expand and view.carry_bias(x, node):
            return view.set(node, p)
        view.replicate(x, node)
        return view.set(node, R)
    if not isinstance(p, Shard):
        return view.set(node, R)
    nd_out = val(node).ndim
    d = norm(p.dim, nd_in)
    origins = view.orig(x)
    if perm is not None:
        e = perm.index(d)
    elif pk is aten.unsqueeze:
        u = norm(node.args[1], nd_out)
        e = d + 1 if u <= d else d
    elif pk is aten.squeeze:
        ins = list(val(x).shape)
        e = d - sum(1 for i in range(d) if ins[i] == 1 and (len(node.args) < 2 or i in
                    [norm(j, nd_in) for j in (node.args[1] if isinstance(node.args[1], (list, tuple))
                                              else [node.args[1]])]))
    else:  # expand
        e = d + nd_out - nd_in
        sizes = list(node.args[1])
        if sizes[e] != -1:
            sizes[e] = sizes[e] // view.tp
        view.rewrite_args((x, sizes) + tuple(node.args[2:]))
    return view.set(node, Shard(e, p.blocks), origins)


@register(aten.view_as_complex, aten.view_as_real)
def complex_view(view, node):
    """A real ``[..., n, 2]`` seen as complex ``[..., n]`` and back (rotary embeddings in complex
    arithmetic, as Llama 4's). Precondition: the split dim is not the pair dim, which
    view_as_complex removes and view_as_real adds last; it stays where it is. A partial sum is
    reduced first (g); an unsplit input is carried."""
    x = node.args[0]
    p = view.get(x)
    if isinstance(p, Partial) or p is None:
        view.replicate(x, node) if isinstance(p, Partial) else view.claim(x, R, where(node))
        return view.set(node, R)
    if not isinstance(p, Shard):
        return view.set(node, p)
    nd = val(x).ndim
    d = norm(p.dim, nd)
    if packet(node) is aten.view_as_complex and d == nd - 1:
        view.demote(view.orig(x), node, "views the split dim as the real and imaginary parts")
    return view.set(node, Shard(d, p.blocks), view.orig(x))


@register(aten.split, aten.split_with_sizes, aten.chunk)
def split(view, node):
    """Splits a tensor into pieces. Along another dim than the split one: each piece keeps
    the split. Along the split dim: precondition that the split dim is made of exactly
    these pieces as fused blocks (a fused QKV). The first time a column matmul's split
    meets such a split it is asked to lay its output out in those blocks (restart);
    pieces that do not match the blocks demote the matmul. Sizes are divided by tp."""
    pk = packet(node)
    x, dim = node.args[0], (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
    p = view.get(x)
    outs = val(node)
    if p is None:
        return replicate_all(view, node, "")
    if isinstance(p, Partial):
        view.replicate(x, node)
        p = R
    if not isinstance(p, Shard):
        return view.set(node, tuple(R for _ in outs))
    nd = val(x).ndim
    dim = norm(dim, nd)
    origins = view.orig(x)
    if norm(p.dim, nd) != dim:
        return view.set(node, tuple(p for _ in outs), origins)
    sizes = tuple(o.shape[dim] for o in outs)
    if p.blocks != sizes:
        if p.blocks is None and origins and all(m not in view.blocks_req for m in origins):
            view.blocks(origins, sizes)
        view.demote(origins, node, f"splits the split dim into {list(sizes)}, "
                                    f"not matching its blocks {p.blocks}")
    if pk is aten.chunk:
        view.rewrite_args(tuple(node.args))
    elif pk is aten.split and not isinstance(node.args[1], (list, tuple)):
        view.rewrite_args((x, node.args[1] // view.tp) + tuple(node.args[2:]))
    else:
        view.rewrite_args((x, [s // view.tp for s in node.args[1]]) + tuple(node.args[2:]))
    return view.set(node, tuple(Shard(dim) for _ in outs), origins)
