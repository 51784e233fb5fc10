"""Tensor parallelism by placement propagation (Megatron 2019, as a graph pass).

``plan_tensor_parallel`` walks the ATen graph once per attempt and gives every
tensor a placement (Replicate / Shard(dim) / Partial) from per-op rules:

* a matmul whose weight is a parameter and whose input is replicated is
  *column*-parallel (weight split on its output features, output Shard(-1));
  one whose input is split on the contraction dim is *row*-parallel (weight
  split on its input features, output Partial);
* elementwise ops, views, attention and norms carry a split through when the
  split dim survives them;
* an embedding looked up with ids from the batch is vocab-parallel (Partial);
  a cross-entropy over class-split logits is vocab-parallel.

When a split cannot be carried (a norm over the split dim, a residual add with
a replicated activation, ...) the column matmuls it came from are *demoted* to
replicated, the reason is recorded, and propagation starts again. The loop
ends at a fixed point: every attempt demotes something new or finishes.

With ``sequence_parallel=True`` (Korthikanti et al. 2022) a partial sum that
flows into norms, dropout and residual adds is reduce-scattered along the
sequence (the second-to-last dim of [..., s, h] activations) instead of
all-reduced, and those ops run on sequence shards; a sequence shard that reaches
anything else (a column-parallel matmul, a view merging the sequence) is
all-gathered there. Sequence shards are never demoted, only gathered.

``apply_tensor_parallel`` rewrites the graph from the plan: Megatron's f
(``copy_to_tp``) where a replicated activation enters a split region, g
(``reduce_from_tp``) where a partial sum must become whole, shape arguments of
views/expands/splits divided by tp, vocab-parallel embedding and loss. The
rewritten graph expects parameters to be the rank's local shards.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, Optional, Set, Tuple

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.ops.collectives import (all_gather_seq, copy_to_tp, gather_seq, local_shard, reduce_from_tp,
                           scatter_seq, split_seq)
from fxmegatron.errors import ShardingError
from fxmegatron.placement import Partial, Placement, R, Replicate, Shard
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding

aten = torch.ops.aten

_VIEWS = {aten.view, aten.reshape, aten._unsafe_view}
# Ops through which a partial sum stays a partial sum.
_KEEP_PARTIAL = _VIEWS | {aten.alias, aten.clone, aten.contiguous, aten.transpose, aten.t,
                          aten.permute, aten.unsqueeze, aten.squeeze}
_ELEMENTWISE_EXTRA = {aten.dropout, aten.to, aten._to_copy, aten.type_as, aten.masked_fill,
                      aten.where, aten.alias, aten.clone, aten.contiguous, aten.detach,
                      aten.lift_fresh_copy, aten.gelu, aten.silu, aten.native_dropout}
_SOFTMAX = {aten._softmax, aten.softmax, aten._log_softmax, aten.log_softmax}
_REDUCE = {aten.sum, aten.mean, aten.amax, aten.amin}
_NO_GRAD = {aten.detach, aten.lift_fresh_copy}


SEQ = "<sequence>"   # origin marker of sequence shards: on conflict they are gathered


class _Restart(Exception):
    """Propagation learnt a constraint (demotion, forced replica, blocks); start over."""


@dataclass
class Decision:
    kind: str          # column | row | replicated | vocab
    reason: str = ""


@dataclass
class TPPlan:
    tp: int
    node_plc: Dict[fx.Node, object] = field(default_factory=dict)
    decisions: Dict[fx.Node, Decision] = field(default_factory=dict)
    param_plc: Dict[str, Placement] = field(default_factory=dict)
    replicated_params: Dict[str, str] = field(default_factory=dict)
    g_edges: Dict[fx.Node, Set[fx.Node]] = field(default_factory=dict)
    f_edges: Dict[fx.Node, Set[fx.Node]] = field(default_factory=dict)
    slice_edges: Dict[Tuple[fx.Node, int], Set[fx.Node]] = field(default_factory=dict)
    arg_rewrites: Dict[fx.Node, tuple] = field(default_factory=dict)
    scatter_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)
    gather_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)       # into column matmuls
    gather_full_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)  # anywhere else
    split_edges: Dict[fx.Node, Tuple[int, Set[fx.Node]]] = field(default_factory=dict)
    bias_after: Dict[fx.Node, fx.Node] = field(default_factory=dict)
    row_bias: Set[fx.Node] = field(default_factory=set)
    sequence_parallel: bool = False
    attempts: int = 0


def _packet(node):
    t = node.target
    return getattr(t, "overloadpacket", t)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_tensor_node(n):
    return isinstance(n, fx.Node) and isinstance(_val(n), torch.Tensor)


def _where(node) -> str:
    mod = module_path(node)
    return f"node {node.name} ({_packet(node)}){' in ' + mod if mod else ''}"


def _norm(d, nd):
    return d + nd if d < 0 else d


def _view_groups(ins, outs):
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
        # trailing size-1 dims belong to their own groups
        groups.append((gi, gj))
    return groups


class _Planner:
    def __init__(self, gm: fx.GraphModule, tp: int, param_names: Set[str], sequence_parallel=False):
        self.gm, self.tp, self.param_names, self.sp = gm, tp, param_names, sequence_parallel
        self.force_gather: Set[Tuple[fx.Node, fx.Node]] = set()
        self.demoted: Dict[fx.Node, str] = {}
        self.forced_rep: Dict[str, str] = {}
        self.blocks_req: Dict[fx.Node, Tuple[int, ...]] = {}
        nodes = list(gm.graph.nodes)
        # which values depend on the batch, which on parameters (need gradients)
        self.from_input: Set[fx.Node] = set()
        self.needs_grad: Set[fx.Node] = set()
        for n in nodes:
            ins = n.all_input_nodes
            if n.op == "placeholder" or any(a in self.from_input for a in ins):
                self.from_input.add(n)
            if n.op == "get_attr" and n.target in param_names:
                self.needs_grad.add(n)
            elif (n.op == "call_function" and _packet(n) not in _NO_GRAD
                  and not (n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not n.args[0])
                  and any(a in self.needs_grad for a in ins)):
                self.needs_grad.add(n)

    # ---- bookkeeping ---------------------------------------------------------
    def _reset(self):
        self.plan = TPPlan(self.tp, sequence_parallel=self.sp)
        self.plc: Dict[fx.Node, object] = self.plan.node_plc
        self.cur: Optional[fx.Node] = None
        self.pending_bias: Dict[fx.Node, fx.Node] = {}
        self.free: Dict[fx.Node, Tuple[str, Tuple[int, ...]]] = {}
        self.origin: Dict[fx.Node, frozenset] = {}
        self.claims: Dict[str, str] = {}

    def run(self) -> TPPlan:
        for attempt in range(1, 10_000):
            self._reset()
            try:
                for node in self.gm.graph.nodes:
                    self._visit(node)
            except _Restart:
                continue
            self.plan.attempts = attempt
            self.plan.replicated_params = dict(self.forced_rep)
            for n, why in self.demoted.items():
                d = self.plan.decisions.get(n)
                if d is not None and d.kind == "replicated" and not d.reason:
                    d.reason = why
            return self.plan
        raise RuntimeError("tensor-parallel planning did not converge")

    def get(self, n):
        """Placement of ``n`` as the node being visited sees it (after g / scatter / gather)."""
        c = self.cur
        if c is not None and isinstance(n, fx.Node):
            if (c in self.plan.g_edges.get(n, ()) or c in self.plan.gather_edges.get(n, (0, ()))[1]
                    or c in self.plan.gather_full_edges.get(n, (0, ()))[1]):
                return R
            for edges in (self.plan.scatter_edges, self.plan.split_edges):
                if c in edges.get(n, (0, ()))[1]:
                    return Shard(edges[n][0])
        return self._base(n)

    def orig(self, n):
        """The column matmuls a split came from, or SEQ for a sequence shard."""
        c = self.cur
        if c is not None:
            for edges in (self.plan.scatter_edges, self.plan.split_edges):
                if c in edges.get(n, (0, ()))[1]:
                    return frozenset([SEQ])
        return self.origin.get(n, frozenset())

    def _base(self, n):
        if n in self.free:
            pname, dmap = self.free[n]
            pp = self.plan.param_plc.get(pname)
            if pp is None:
                return None
            if isinstance(pp, Shard):
                return Shard(dmap.index(pp.dim), pp.blocks)
            return pp
        return self.plc.get(n, R)

    def claim(self, n, want: Placement, why: str) -> bool:
        """Ask that a parameter-derived value be laid out as ``want``."""
        if n not in self.free:
            return self.get(n) == want
        pname, dmap = self.free[n]
        if isinstance(want, Shard):
            pw = Shard(dmap[want.dim], want.blocks)
        else:
            pw = R
        if pname in self.forced_rep:
            return isinstance(pw, Replicate)
        cur = self.plan.param_plc.get(pname)
        if cur is None:
            self.plan.param_plc[pname] = pw
            self.claims[pname] = why
            return True
        if cur == pw:
            return True
        self.forced_rep[pname] = (f"parameter {pname} is needed as {cur} by {self.claims[pname]} "
                                  f"and as {pw} by {why}")
        raise _Restart

    def demote(self, origins, node, why):
        if SEQ in origins:   # a sequence shard that cannot go on: gather it here instead
            seq_inputs = [a for a in node.all_input_nodes if SEQ in self.orig(a)]
            new = {(a, node) for a in seq_inputs} - self.force_gather
            if new:
                self.force_gather |= new
                raise _Restart
            origins = set(origins) - {SEQ}
        origins = set(origins) - set(self.demoted)
        if not origins:
            raise RuntimeError(f"internal: conflict at {_where(node)} with no matmul to demote: {why}")
        for m in origins:
            self.demoted[m] = f"its output reaches {_where(node)}, which {why}"
        raise _Restart

    def replicate(self, a, consumer):
        """``consumer`` needs ``a`` whole: reduce a partial sum (g) or fail on a shard."""
        p = self.get(a)
        if isinstance(p, Partial):
            self.plan.g_edges.setdefault(a, set()).add(consumer)
            if a in self.pending_bias:
                self.plan.bias_after[a] = self.pending_bias[a]
        elif isinstance(p, Shard) and SEQ in self.orig(a):
            self._gather(a, consumer)
        elif isinstance(p, Shard):
            self.demote(self.orig(a), consumer, f"needs its input {a.name} whole")
        elif p is None:
            self.claim(a, R, _where(consumer))

    def _gather(self, a, consumer, into_column=False):
        """All-gather a sequence shard for ``consumer``. Into a column-parallel matmul the
        gather's backward reduce-scatters (it is Megatron's f as well); anywhere else the
        gathered value starts an ordinary replicated region whose gradient is whole, so the
        backward only keeps this rank's slice."""
        dim = _norm(self._base(a).dim, _val(a).ndim)
        edges = self.plan.gather_edges if into_column else self.plan.gather_full_edges
        edges.setdefault(a, (dim, set()))[1].add(consumer)

    def reduce_partial(self, a, consumer):
        """Make a partial sum whole for an op that can run on sequence shards:
        reduce-scatter along the sequence under sequence parallelism, else all-reduce."""
        v = _val(a)
        if self.sp and v.ndim >= 3 and v.shape[-2] % self.tp == 0:
            self.plan.scatter_edges.setdefault(a, (v.ndim - 2, set()))[1].add(consumer)
            if a in self.pending_bias:
                self.plan.bias_after[a] = self.pending_bias[a]
        else:
            self.replicate(a, consumer)

    def set(self, node, plc, origins=frozenset()):
        self.plc[node] = plc
        if origins:
            self.origin[node] = frozenset(origins)

    # ---- dispatch ------------------------------------------------------------
    def _visit(self, node):
        if node.op == "placeholder":
            self.set(node, R)
        elif node.op == "get_attr":
            if node.target in self.param_names:
                self.free[node] = (node.target, tuple(range(_val(node).ndim)))
            else:
                self.set(node, R)
        elif node.op == "output":
            for a in node.all_input_nodes:
                self.replicate(a, node)
        elif node.op == "call_function":
            self._call(node)
        else:
            for a in node.all_input_nodes:
                self.replicate(a, node)
            self.set(node, R)

    def _call(self, node):
        self.cur = node
        for a in node.all_input_nodes:
            if (a, node) in self.force_gather:
                self._gather(a, node)
        pk = _packet(node)
        if node.target is operator.getitem:
            src = self.get(node.args[0])
            self.set(node, src[node.args[1]] if isinstance(src, tuple) else R, self.orig(node.args[0]))
            return
        if pk in (aten.linear, aten.addmm, aten.mm, aten.matmul, aten.bmm):
            return self._matmul(node, pk)
        if pk is aten.embedding:
            return self._embedding(node)
        if pk is aten.cross_entropy_loss:
            return self._cross_entropy(node)
        if pk is aten.scaled_dot_product_attention:
            return self._sdpa(node)
        if pk in _VIEWS:
            return self._view(node)
        if pk in (aten.transpose, aten.t, aten.permute, aten.unsqueeze, aten.squeeze, aten.expand):
            return self._layout(node, pk)
        if pk in (aten.split, aten.split_with_sizes, aten.chunk):
            return self._split(node, pk)
        if pk is aten.layer_norm:
            return self._layer_norm(node)
        if pk in _SOFTMAX or pk in _REDUCE or pk in (aten.slice, aten.select, aten.cat):
            return self._dim_op(node, pk)
        if pk is aten._assert_tensor_metadata:
            return self.set(node, R)
        if isinstance(pk, torch._ops.OpOverloadPacket) and (
                torch.Tag.pointwise in node.target.tags or pk in _ELEMENTWISE_EXTRA):
            return self._elementwise(node, pk)
        return self._opaque(node, f"has no sharding rule for {pk}")

    # ---- rules ---------------------------------------------------------------
    def _opaque(self, node, why):
        for a in node.all_input_nodes:
            if isinstance(self.get(a), Shard):
                self.demote(self.orig(a), node, why)
            self.replicate(a, node)
        v = _val(node)
        self.set(node, tuple(R for _ in v) if isinstance(v, (tuple, list)) else R)

    def _shard_inputs(self, node):
        out = []
        for a in node.all_input_nodes:
            p = self.get(a)
            if isinstance(p, Shard):
                out.append((a, p))
        return out

    def _elementwise(self, node, pk):
        out = _val(node)
        if not isinstance(out, torch.Tensor):
            return self._opaque(node, "returns a non-tensor")
        nd = out.ndim
        tensors = [a for a in node.all_input_nodes if _is_tensor_node(a) or a in self.free]
        partials = [a for a in tensors if isinstance(self.get(a), Partial)]
        split = [a for a, _ in self._shard_inputs(node) if SEQ not in self.orig(a)]
        if partials and not self._shard_inputs(node) and pk in _KEEP_PARTIAL and len(partials) == 1:
            self._carry_bias(partials[0], node)
            return self.set(node, Partial())
        for a in partials:
            self.replicate(a, node) if split else self.reduce_partial(a, node)
        shards = self._shard_inputs(node)
        if not shards:
            for a in tensors:
                if self.get(a) is None:
                    self.claim(a, R, _where(node))
            return self.set(node, R)
        origins = set().union(*(self.orig(a) for a, _ in shards))
        dims = {(p.dim + nd - _val(a).ndim, p.blocks) for a, p in shards}
        if len(dims) > 1:
            self.demote(origins, node, f"combines inputs split along different dims {sorted(map(str, dims))}")
        d, blocks = dims.pop()
        seq = SEQ in origins
        for a in tensors:
            if isinstance(self.get(a), Shard):
                continue
            ad = d - (nd - _val(a).ndim)
            if ad < 0 or _val(a).shape[ad] == 1:
                # broadcast along the split dim: each rank's gradient is a partial sum -> f
                if a in self.free:
                    self.claim(a, R, _where(node))
                if a in self.free or a in self.needs_grad:
                    self.plan.f_edges.setdefault(a, set()).add(node)
                continue
            if a in self.free and not seq:
                if not self.claim(a, Shard(ad, blocks), _where(node)):
                    self.demote(origins, node, f"uses parameter {self.free[a][0]} that must stay replicated")
            elif a not in self.needs_grad and a not in self.free and blocks is None:
                self.plan.slice_edges.setdefault((a, ad), set()).add(node)
            elif seq:
                if a in self.free:
                    self.claim(a, R, _where(node))
                self.plan.split_edges.setdefault(a, (ad, set()))[1].add(node)
            else:
                self.demote(origins, node, f"combines it with the replicated activation {a.name}")
        self.set(node, Shard(d, blocks), origins)

    def _carry_bias(self, x, node):
        """A deferred row-parallel bias rides along views that keep the last dim."""
        if x in self.pending_bias:
            if _val(node).shape[-1] == _val(x).shape[-1]:
                self.pending_bias[node] = self.pending_bias[x]
            else:
                self.replicate(x, node)
                return False
        return True

    def _matmul(self, node, pk):
        args = node.args
        if pk is aten.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else node.kwargs.get("bias")
            w_out, w_in = 0, 1
        elif pk is aten.addmm:
            b, x, w = args[0], args[1], args[2]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                return self._opaque(node, "is an addmm with alpha/beta")
            w_out, w_in = 1, 0
        else:
            x, w, b = args[0], args[1], None
            w_out, w_in = 1, 0
        if w not in self.free or _val(w) is None or _val(w).ndim != 2:
            return self._activation_matmul(node, x, w)
        if isinstance(self.get(x), Partial):
            self.replicate(x, node)
        if isinstance(self.get(x), Shard) and SEQ in self.orig(x):
            self._gather(x, node, into_column=True)
        px = self.get(x)
        xnd = _val(x).ndim
        gathered_here = node in self.plan.gather_edges.get(x, (0, ()))[1]
        pname = self.free[w][0]
        where = f"{_where(node)} (weight {pname})"
        if isinstance(px, Shard) and _norm(px.dim, xnd) == xnd - 1:
            if pname in self.forced_rep:
                self.demote(self.orig(x), node, f"is replicated: {self.forced_rep[pname]}")
            self.claim(w, Shard(w_in, px.blocks), where)
            if b is not None:   # added after the reduction: see pending_bias
                self.claim(b, R, where)
                self.plan.row_bias.add(node)
                self.pending_bias[node] = b
            self.plan.decisions[node] = Decision("row")
            return self.set(node, Partial())
        if isinstance(px, Shard):
            self.demote(self.orig(x), node, f"contracts dim {xnd - 1}, not the split dim {px.dim}")
        reason = self.demoted.get(node) or self.forced_rep.get(pname)
        if reason is None:
            n_out = _val(w).shape[w_out]
            blocks = self.blocks_req.get(node)
            for size in (blocks or (n_out,)):
                if size % self.tp:
                    raise ShardingError(
                        f"tp={self.tp} does not divide the {size} output features of {where}"
                        f"{' (one of its fused blocks ' + str(list(blocks)) + ')' if blocks else ''}: "
                        "a column-parallel matmul splits its output features evenly over tp ranks")
            self.claim(w, Shard(w_out, blocks), where)
            if b is not None:
                self.claim(b, Shard(0, blocks), where)
            if x in self.needs_grad and not gathered_here:
                self.plan.f_edges.setdefault(x, set()).add(node)
            self.plan.decisions[node] = Decision("column")
            return self.set(node, Shard(_val(node).ndim - 1, blocks), {node})
        if gathered_here:   # not column after all: its input gradient is whole
            self.plan.gather_edges[x][1].discard(node)
            self.plan.gather_full_edges.setdefault(x, (self.plan.gather_edges[x][0], set()))[1].add(node)
        self.claim(w, R, where)
        if b is not None:
            self.claim(b, R, where)
        self.plan.decisions[node] = Decision("replicated", reason)
        self.set(node, R)

    def _activation_matmul(self, node, x, w):
        for a in (x, w):
            if isinstance(self.get(a), Partial) or self.get(a) is None:
                self.replicate(a, node)
        px, pw = self.get(x), self.get(w)
        nd = _val(node).ndim
        if isinstance(px, Replicate) and isinstance(pw, Replicate):
            return self.set(node, R)
        origins = self.orig(x) | self.orig(w)
        if isinstance(px, Shard) and isinstance(pw, Shard):
            dx = px.dim + nd - _val(x).ndim
            dw = pw.dim + nd - _val(w).ndim
            if dx == dw and dx < nd - 2 and px.blocks is None and pw.blocks is None:
                return self.set(node, Shard(dx), origins)
        self.demote(origins, node, "is a matmul of activations not split along the same batch dim")

    def _embedding(self, node):
        w, ids = node.args[0], node.args[1]
        pname = self.free[w][0] if w in self.free else None
        reason = None
        if pname is None:
            reason = "its table is not a parameter"
        elif pname in self.forced_rep:
            reason = self.forced_rep[pname]
        elif ids not in self.from_input:
            reason = "its indices are computed in the graph (e.g. positions), not read from the batch"
        if reason is None:
            vocab = _val(w).shape[0]
            if vocab % self.tp:
                raise ShardingError(
                    f"tp={self.tp} does not divide the vocabulary ({vocab} rows of {pname}) of the "
                    f"embedding at {_where(node)}: pad the vocabulary to a multiple of tp")
            self.claim(w, Shard(0), _where(node))
            self.plan.decisions[node] = Decision("vocab")
            return self.set(node, Partial())
        self.claim(w, R, _where(node))
        self.plan.decisions[node] = Decision("replicated", reason)
        self.set(node, R)

    def _cross_entropy(self, node):
        logits, target = node.args[0], node.args[1]
        p = self.get(logits)
        if isinstance(p, Partial):
            self.replicate(logits, node)
            p = R
        if isinstance(p, Shard):
            nd = _val(logits).ndim
            weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
            smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
            if nd != 2 or _norm(p.dim, nd) != 1 or p.blocks is not None:
                self.demote(self.orig(logits), node, "is a cross-entropy over logits not split by class")
            if weight is not None or smoothing:
                self.demote(self.orig(logits), node,
                            "is a cross-entropy with class weights or label smoothing (no vocab-parallel form)")
            self.replicate(target, node)
            self.plan.decisions[node] = Decision("vocab")
            return self.set(node, R)
        self._opaque(node, "")

    def _sdpa(self, node):
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        for a in (q, k, v):
            if isinstance(self.get(a), Partial):
                self.replicate(a, node)
        ps = [self.get(a) for a in (q, k, v)]
        origins = set().union(*(self.orig(a) for a in (q, k, v)))
        if all(isinstance(p, Replicate) for p in ps):
            if isinstance(mask, fx.Node):
                self.replicate(mask, node)
            return self.set(node, R)
        if not all(isinstance(p, Shard) and _norm(p.dim, 4) == 1 and p.blocks is None for p in ps):
            self.demote(origins, node, f"needs q, k, v all split by heads (dim 1), got {[str(p) for p in ps]}")
        if isinstance(mask, fx.Node):
            mp = self.get(mask)
            mv = _val(mask)
            md = 1 - (4 - mv.ndim)
            if isinstance(mp, Shard):
                if _norm(mp.dim, mv.ndim) != md:
                    self.demote(origins | self.orig(mask), node, "has a mask split off the heads dim")
            elif md >= 0 and mv.shape[md] != 1:
                if mask in self.needs_grad:
                    self.demote(origins, node, "has a per-head mask that needs gradients")
                self.replicate(mask, node)
                self.plan.slice_edges.setdefault((mask, md), set()).add(node)
            else:
                self.replicate(mask, node)
        self.set(node, Shard(1), origins)

    def _view(self, node):
        x = node.args[0]
        p = self.get(x)
        if p is None:
            return self._opaque(node, "")
        if isinstance(p, Partial):
            return self.set(node, p if self._carry_bias(x, node) else R)
        if not isinstance(p, Shard):
            return self.set(node, p)
        ins = list(_val(x).shape)
        outs = list(_val(node).shape)
        d = _norm(p.dim, len(ins))
        origins = self.orig(x)
        for gi, gj in _view_groups(ins, outs):
            if d not in gi:
                continue
            gi_big = [i for i in gi if ins[i] != 1]
            gj_big = [j for j in gj if outs[j] != 1]
            if SEQ in origins and (len(gi_big) > 1 or len(gj_big) > 1):
                self._gather(x, node)      # e.g. [b, s, h] -> [b*s, h]: gather the sequence first
                return self.set(node, R)
            if not gj_big or gi_big[0] != d:
                self.demote(origins, node, f"merges split dim {d} of {ins} into a later position")
            e = gj_big[0]
            if len(gj_big) > 1 or len(gi_big) > 1:
                if p.blocks is not None:
                    self.demote(origins, node, "reshapes a dim made of fused blocks")
            if outs[e] % self.tp:
                owner = ", ".join(sorted(module_path(m) or m.name for m in origins))
                raise ShardingError(
                    f"tp={self.tp} does not divide dim {e} (size {outs[e]}) of the view {ins} -> {outs} "
                    f"at {_where(node)}; that dim carries the split features of {owner} "
                    "(for attention these are the heads or kv heads)")
            sizes = list(node.args[1])
            if isinstance(sizes[e], fx.Node):
                sizes[e] = ("floordiv", sizes[e])
            elif sizes[e] != -1:
                sizes[e] = sizes[e] // self.tp
            self.plan.arg_rewrites[node] = (x, sizes) + tuple(node.args[2:])
            return self.set(node, Shard(e, p.blocks), origins)
        raise RuntimeError(f"internal: view dims not matched at {_where(node)}")

    def _layout(self, node, pk):
        x = node.args[0]
        p = self.get(x)
        if p is None:   # layout op on a parameter: still free, remember the dim map
            pname, dmap = self.free[x]
            nd = len(dmap)
            if pk is aten.t or (pk is aten.transpose and nd == 2):
                self.free[node] = (pname, tuple(reversed(dmap)))
                return
            if pk is aten.permute:
                self.free[node] = (pname, tuple(dmap[i] for i in node.args[1]))
                return
            return self._opaque(node, "")
        if isinstance(p, Partial):
            if pk in _KEEP_PARTIAL and self._carry_bias(x, node):
                return self.set(node, p)
            self.replicate(x, node)
            return self.set(node, R)
        if not isinstance(p, Shard):
            return self.set(node, R)
        nd_in = _val(x).ndim
        nd_out = _val(node).ndim
        d = _norm(p.dim, nd_in)
        origins = self.orig(x)
        if pk is aten.t:
            e = 1 - d if nd_in == 2 else d
        elif pk is aten.transpose:
            a, b = _norm(node.args[1], nd_in), _norm(node.args[2], nd_in)
            e = b if d == a else a if d == b else d
        elif pk is aten.permute:
            e = [_norm(i, nd_in) for i in node.args[1]].index(d)
        elif pk is aten.unsqueeze:
            u = _norm(node.args[1], nd_out)
            e = d + 1 if u <= d else d
        elif pk is aten.squeeze:
            ins = list(_val(x).shape)
            e = d - sum(1 for i in range(d) if ins[i] == 1 and (len(node.args) < 2 or i in
                        [_norm(j, nd_in) for j in (node.args[1] if isinstance(node.args[1], (list, tuple))
                                                   else [node.args[1]])]))
        else:  # expand
            e = d + nd_out - nd_in
            sizes = list(node.args[1])
            if sizes[e] != -1:
                sizes[e] = sizes[e] // self.tp
            self.plan.arg_rewrites[node] = (x, sizes) + tuple(node.args[2:])
        self.set(node, Shard(e, p.blocks), origins)

    def _split(self, node, pk):
        x, dim = node.args[0], (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
        p = self.get(x)
        outs = _val(node)
        if p is None:
            return self._opaque(node, "")
        if isinstance(p, Partial):
            self.replicate(x, node)
            p = R
        if not isinstance(p, Shard):
            return self.set(node, tuple(R for _ in outs))
        nd = _val(x).ndim
        dim = _norm(dim, nd)
        origins = self.orig(x)
        if _norm(p.dim, nd) != dim:
            return self.set(node, tuple(p for _ in outs), origins)
        sizes = tuple(o.shape[dim] for o in outs)
        if p.blocks != sizes:
            if p.blocks is None and origins and all(m not in self.blocks_req for m in origins):
                for m in origins:
                    self.blocks_req[m] = sizes
                raise _Restart
            self.demote(origins, node, f"splits the split dim into {list(sizes)}, "
                                       f"not matching its blocks {p.blocks}")
        if pk is aten.chunk:
            self.plan.arg_rewrites[node] = tuple(node.args)
        elif pk is aten.split and not isinstance(node.args[1], (list, tuple)):
            self.plan.arg_rewrites[node] = (x, node.args[1] // self.tp) + tuple(node.args[2:])
        else:
            self.plan.arg_rewrites[node] = (x, [s // self.tp for s in node.args[1]]) + tuple(node.args[2:])
        self.set(node, tuple(Shard(dim) for _ in outs), origins)

    def _layer_norm(self, node):
        x, shape = node.args[0], node.args[1]
        if isinstance(self.get(x), Partial):
            self.reduce_partial(x, node)
        p = self.get(x)
        nd = _val(x).ndim
        for a in node.args[2:4]:
            if isinstance(a, fx.Node):
                if a in self.free:
                    self.claim(a, R, _where(node))
                else:
                    self.replicate(a, node)
                if isinstance(p, Shard) and (a in self.free or a in self.needs_grad):
                    self.plan.f_edges.setdefault(a, set()).add(node)   # grads are partial sums
        if isinstance(p, Shard):
            if _norm(p.dim, nd) >= nd - len(shape):
                self.demote(self.orig(x), node, "normalises over the split dim")
            return self.set(node, p, self.orig(x))
        self.set(node, R)

    def _dim_op(self, node, pk):
        if pk is aten.cat:
            tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
            nd = _val(node).ndim
            ps = [self.get(a) for a in tensors]
            if all(isinstance(p, Replicate) for p in ps):
                return self.set(node, R)
            origins = set().union(*(self.orig(a) for a in tensors))
            if all(isinstance(p, Shard) for p in ps) and len({(_norm(p.dim, nd), p.blocks) for p in ps}) == 1 \
                    and _norm(ps[0].dim, nd) != _norm(dim, nd) and ps[0].blocks is None:
                return self.set(node, ps[0], origins)
            if origins:
                self.demote(origins, node, "concatenates differently split inputs or along the split dim")
            return self._opaque(node, "")
        x = node.args[0]
        p = self.get(x)
        if not isinstance(p, Shard):
            return self._opaque(node, "")
        nd = _val(x).ndim
        d = _norm(p.dim, nd)
        origins = self.orig(x)
        if pk in _SOFTMAX:
            if _norm(node.args[1], nd) == d:
                self.demote(origins, node, "takes a softmax over the split dim")
            return self.set(node, p, origins)
        if pk is aten.slice:
            dim = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
            full = (len(node.args) < 3 or node.args[2] in (0, None)) and (
                len(node.args) < 4 or node.args[3] is None or node.args[3] >= _val(x).shape[dim])
            if dim == d and not full:
                self.demote(origins, node, "slices the split dim")
            return self.set(node, p, origins)
        if pk is aten.select:
            dim = _norm(node.args[1], nd)
            if dim == d:
                self.demote(origins, node, "selects along the split dim")
            return self.set(node, Shard(d - (dim < d), p.blocks), origins)
        # reductions
        dims = node.args[1] if len(node.args) > 1 else None
        dims = list(range(nd)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
        dims = [_norm(i, nd) for i in dims]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if d in dims:
            self.demote(origins, node, "reduces over the split dim")
        e = d if keep else d - sum(1 for i in dims if i < d)
        self.set(node, Shard(e, p.blocks), origins)


def plan_tensor_parallel(gm: fx.GraphModule, tp: int, param_names, sequence_parallel: bool = False) -> TPPlan:
    """Placements for every node and a decision for every matmul, embedding and loss."""
    return _Planner(gm, tp, set(param_names), sequence_parallel).run()


def apply_tensor_parallel(gm: fx.GraphModule, plan: TPPlan, rank: int, group_name: str) -> fx.GraphModule:
    """Rewrite ``gm`` in place for one rank from ``plan`` (parameters become local shards)."""
    g = gm.graph
    tp = plan.tp

    def mark(n, plc):
        n.meta["placement"] = plc
        return n

    for node in list(g.nodes):
        if node in plan.arg_rewrites:
            args = list(plan.arg_rewrites[node])
            if len(args) > 1 and isinstance(args[1], list):
                sizes = []
                for s in args[1]:
                    if isinstance(s, tuple) and s[0] == "floordiv":
                        with g.inserting_before(node):
                            s = g.call_function(operator.floordiv, (s[1], tp))
                    sizes.append(s)
                args[1] = sizes
            node.args = tuple(args)
        dec = plan.decisions.get(node)
        if dec is None:
            continue
        node.meta["tp_decision"] = f"{dec.kind}" + (f": {dec.reason}" if dec.reason else "")
        pk = _packet(node)
        if dec.kind == "row" and node in plan.row_bias and tp > 1:
            # the bias is added after the reduction (g or reduce-scatter): see bias_after
            if pk is aten.linear:
                node.args, node.kwargs = node.args[:2], {}
            else:   # addmm(b, x, w) -> mm(x, w)
                node.target, node.args, node.kwargs = aten.mm.default, (node.args[1], node.args[2]), {}
        elif dec.kind == "vocab" and pk is aten.embedding:
            w, ids = node.args[0], node.args[1]
            vocab = node.args[0].meta["val"].shape[0] // tp
            node.target, node.args, node.kwargs = vocab_parallel_embedding, (w, ids, rank * vocab), {}
        elif dec.kind == "vocab" and pk is aten.cross_entropy_loss:
            logits, target = node.args[0], node.args[1]
            reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
            ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
            vocab = logits.meta["val"].shape[1] // tp
            node.target = vocab_parallel_cross_entropy
            node.args, node.kwargs = (logits, target, rank * vocab, group_name, reduction, ignore), {}

    def insert_after(src, fn, args, plc):
        with g.inserting_after(src):
            n = g.call_function(fn, args)
        n.meta["nn_module_stack"] = src.meta.get("nn_module_stack")
        return mark(n, plc)

    def rewire(src, new, users):
        for u in users:
            u.replace_input_with(src, new)

    def with_bias(src, red, f_bias):
        """A deferred row-parallel bias, added after the reduction."""
        b = plan.bias_after.get(src) if tp > 1 else None    # at tp=1 the bias stays in the matmul
        if b is None:
            return red
        if f_bias:   # on sequence shards each rank sees part of the bias's gradient
            b = insert_after(b, copy_to_tp, (b, group_name), R)
        with g.inserting_after(red):
            out = g.call_function(aten.add.Tensor, (red, b))
        out.meta["nn_module_stack"] = red.meta.get("nn_module_stack")
        return mark(out, red.meta["placement"])

    reduced = {}
    for src, users in plan.g_edges.items():
        red = reduced[src] = with_bias(src, insert_after(src, reduce_from_tp, (src, group_name), R), False)
        rewire(src, red, users)
    for src, (dim, users) in plan.scatter_edges.items():
        sc = with_bias(src, insert_after(src, scatter_seq, (src, dim, tp, group_name), Shard(dim)), True)
        rewire(src, sc, users)
    for src, (dim, users) in plan.gather_edges.items():
        if users:
            rewire(src, insert_after(src, gather_seq, (src, dim, tp, group_name), R), users)
    for src, (dim, users) in plan.gather_full_edges.items():
        rewire(src, insert_after(src, all_gather_seq, (src, dim, rank, tp, group_name), R), users)
    for src, (dim, users) in plan.split_edges.items():
        rewire(src, insert_after(src, split_seq, (src, dim, rank, tp, group_name), Shard(dim)), users)
    for src, users in plan.f_edges.items():
        src2 = reduced.get(src, src)
        rewire(src2, insert_after(src2, copy_to_tp, (src2, group_name), R), users)
    for (src, dim), users in plan.slice_edges.items():
        rewire(src, insert_after(src, local_shard, (src, dim, rank, tp), Shard(dim)), users)
    for node, plc in plan.node_plc.items():
        if node.graph is g and "placement" not in node.meta:
            node.meta["placement"] = plc
    for node in g.nodes:
        if node.op == "get_attr" and node.target in plan.param_plc:
            node.meta["placement"] = plan.param_plc[node.target]
    g.lint()
    gm.recompile()
    return gm
