"""Cut a graph into pipeline chunks at transformer-block boundaries.

Blocks are found from the graph itself: the repeated ``<prefix>.<index>`` module
paths of ``nn_module_stack`` (``recompute.block_of``). The graph becomes a row of
*units*: what runs before the first block (embedding), each block, what runs after
the last one (final norm, LM head, loss). Chunks are contiguous runs of units,
balanced by cost (forward FLOPs plus parameters) or set by the user
(``blocks_per_chunk``).

Each chunk is a GraphModule with explicit boundaries::

    chunk_k(*boundary_in, *batch_inputs) -> boundary_out      (last chunk: the graph's output)

``boundary_out`` of chunk k is every value made in chunks <= k and used after k
(values needed two chunks later are relayed), so a chunk only talks to its
neighbours. Batch inputs (token ids, labels) are not sent: every pipeline rank has
the batch. Parameters are referenced by name (``get_attr``), so a weight used in
two chunks (tied embedding and LM head) is the same name in both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from fxmegatron.errors import PipelineSplitError
from fxmegatron.passes.recompute import block_of

aten = torch.ops.aten



@dataclass
class Chunk:
    index: int
    gm: fx.GraphModule
    boundary_in: List[str]          # names of the values received from chunk index-1
    boundary_out: List[str]         # names of the values sent to chunk index+1 ([] for the last)
    batch_inputs: List[int]         # positions in the flat batch that this chunk reads
    units: List[str]                # "pre", block paths, "post"
    cost: float
    params: List[str] = field(default_factory=list)
    boundary_grad: List[bool] = field(default_factory=list)   # per boundary_out: does a gradient flow back

    @property
    def is_last(self) -> bool:
        return not self.boundary_out and "post" in self.units


def _numel(v) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else 0


def node_flops(node: fx.Node, gm: fx.GraphModule) -> float:
    """Forward FLOPs of one node: 2·M·N·K for matrix products, 4·b·h·s_q·s_k·d for
    attention, one per output element for the rest."""
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        body = getattr(sub, "body", sub)
        if isinstance(body, fx.GraphModule):
            return sum(node_flops(n, body) for n in body.graph.nodes)
        return 0.0
    if node.op != "call_function":
        return 0.0
    out = node.meta.get("val")
    name = getattr(node.target, "__name__", str(node.target))
    pk = getattr(node.target, "overloadpacket", None)
    if pk in (aten.mm, aten.addmm, aten.bmm, aten.linear, aten.matmul, aten.baddbmm) or name in ("fp8_linear", "fp8_linear_q"):
        a = node.args[1] if pk in (aten.addmm, aten.baddbmm) else node.args[0]
        k = a.meta["val"].shape[-1] if isinstance(a, fx.Node) else 1
        return 2.0 * _numel(out) * k
    if pk is aten.scaled_dot_product_attention or name == "counter_dropout_attention" \
            or getattr(pk, "_qualified_op_name", None) == "fxmegatron::attention":     # SDPA on CUDA
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        return 4.0 * q.numel() * k.shape[-2]
    if getattr(pk, "_qualified_op_name", None) == "fxmegatron::cp_attention":   # keys of every cp rank
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        return 4.0 * q.numel() * k.shape[-2] * node.args[6]
    return float(_numel(out)) if isinstance(out, torch.Tensor) else 0.0


def _units(gm: fx.GraphModule):
    """unit index per compute node (monotone along data flow) and the unit names."""
    blocks: List[str] = []
    raw: Dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_module"):
            continue
        b = block_of(n)
        if b:
            if b not in blocks:
                blocks.append(b)
            raw[n] = blocks.index(b) + 1
    if not blocks:
        raise PipelineSplitError("pipeline parallelism cuts at transformer blocks, and this graph has none: no "
                            "module path ends in an index (e.g. 'layers.0'); use pp=1")
    unit: Dict[fx.Node, int] = {}
    seen_block = False
    order = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    for i, n in enumerate(order):
        if n in raw:
            u = raw[n]
            seen_block = True
        elif not seen_block:
            u = 0
        else:   # between blocks: belongs to the next block, or to "post" after the last one
            nxt = next((raw[m] for m in order[i + 1:] if m in raw), None)
            u = nxt if nxt is not None else len(blocks) + 1
        deps = [unit[a] for a in n.all_input_nodes if a in unit]
        unit[n] = max([u] + deps)
    # values computed from parameters alone (sequence parallelism's copy_to_tp of a norm weight,
    # a cast of a weight) run where they are first used, not where the graph happens to list
    # them: otherwise chunk 0 computes them and every boundary relays them
    param_only = {}
    for n in order:
        param_only[n] = all(a.op == "get_attr" or param_only.get(a, False) for a in n.all_input_nodes)
    for n in reversed(order):
        users = [unit[x] for x in n.users if x in unit]
        if param_only[n] and users:
            unit[n] = min(users)
    return unit, ["pre"] + blocks + ["post"]


def _balance(costs: Sequence[float], n: int) -> List[int]:
    """Contiguous partition of ``costs`` into ``n`` non-empty parts minimising the largest
    part (dynamic programming); returns the sizes."""
    U = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    INF = float("inf")
    best = [[INF] * (U + 1) for _ in range(n + 1)]
    cut = [[0] * (U + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, U - (n - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], pre[j] - pre[i])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    sizes, j = [], U
    for k in range(n, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def plan_units(gm: fx.GraphModule, n_chunks: int, blocks_per_chunk: Optional[Sequence[int]] = None):
    """(unit per node, unit names, unit costs, chunk per unit)."""
    unit, names = _units(gm)
    costs = [0.0] * len(names)
    params_seen = set()
    for n, u in unit.items():
        costs[u] += node_flops(n, gm)
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a.target not in params_seen:
                params_seen.add(a.target)
                try:
                    costs[u] += gm.get_parameter(a.target).numel()
                except AttributeError:
                    pass
    L = len(names) - 2
    if blocks_per_chunk is not None:
        bpc = list(blocks_per_chunk)
        if len(bpc) != n_chunks or sum(bpc) != L or min(bpc) < 1:
            raise PipelineSplitError(f"blocks_per_chunk={bpc} must have {n_chunks} entries (pp·virtual_stages), each "
                                f">= 1, summing to the {L} transformer blocks found ({names[1]} ... {names[-2]})")
        sizes = list(bpc)
        sizes[0] += 1       # the embedding goes with the first chunk
        sizes[-1] += 1      # the head and loss with the last
    else:
        if n_chunks > L:
            raise PipelineSplitError(f"pp·virtual_stages = {n_chunks} chunks, but the graph has only {L} transformer "
                                f"blocks ({names[1]} ... {names[-2]}): each chunk needs at least one")
        # pre and post ride with their neighbouring block so that every chunk holds a block
        merged = [costs[0] + costs[1]] + costs[2:-2] + [costs[-2] + costs[-1]] if L > 1 else [sum(costs)]
        sizes = _balance(merged, n_chunks)
        sizes[0] += 1
        sizes[-1] += 1
    chunk_of_unit = []
    for k, s in enumerate(sizes):
        chunk_of_unit += [k] * s
    return unit, names, costs, chunk_of_unit


def grad_values(gm: fx.GraphModule) -> set:
    """Nodes whose value depends on a trainable parameter (so a gradient flows into them)."""
    marked = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                t = gm.get_parameter(n.target)
            except AttributeError:
                t = None
            if isinstance(t, torch.Tensor) and t.requires_grad:
                marked.add(n)
        elif n.op in ("call_function", "call_module") and any(a in marked for a in n.all_input_nodes):
            v = n.meta.get("val")
            vals = v if isinstance(v, (tuple, list)) else [v]
            if any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in vals):
                marked.add(n)
    return marked


def split_pipeline(gm: fx.GraphModule, n_chunks: int, n_batch_inputs: Optional[int] = None,
                   blocks_per_chunk: Optional[Sequence[int]] = None) -> List[Chunk]:
    """Cut ``gm`` into ``n_chunks`` GraphModules (``Chunk``), in execution order."""
    unit, names, costs, chunk_of_unit = plan_units(gm, n_chunks, blocks_per_chunk)
    chunk_of = {n: chunk_of_unit[u] for n, u in unit.items()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    # last chunk that uses each produced value
    last_use: Dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        users = [chunk_of.get(u, n_chunks - 1 if u is output else None) for u in n.users]
        users = [c for c in users if c is not None]
        if users and n in chunk_of:
            last_use[n] = max(users)
    needs_grad = grad_values(gm)
    chunks = []
    carried: List[fx.Node] = []     # values entering the current chunk from the previous one
    for k in range(n_chunks):
        g = fx.Graph()
        env: Dict[fx.Node, fx.Node] = {}
        for v in carried:
            env[v] = g.placeholder(v.name)
            env[v].meta = dict(v.meta)
        members = [n for n in gm.graph.nodes if chunk_of.get(n) == k]
        used_batch = []
        for n in members:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a not in used_batch:
                    used_batch.append(a)
        if k == n_chunks - 1:
            for a in output.all_input_nodes:
                if a.op == "placeholder" and a not in used_batch:
                    used_batch.append(a)
        used_batch.sort(key=placeholders.index)
        for a in used_batch:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)

        def arg(a):
            if a not in env:
                if a.op == "get_attr":
                    env[a] = g.get_attr(a.target)
                    env[a].meta = dict(a.meta)
                else:
                    raise PipelineSplitError(f"node {a.name} is needed in chunk {k} but is not available there")
            return env[a]

        for n in members:
            env[n] = g.node_copy(n, arg)
        if k == n_chunks - 1:
            g.output(fx.graph.map_arg(output.args[0], arg))
            out_vals = []
        else:
            out_vals = [v for v in list(carried) + members if last_use.get(v, -1) > k]
            for v in out_vals:
                val = v.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    raise PipelineSplitError(f"value {v.name} ({type(val).__name__}) crosses the pipeline boundary "
                                        f"after chunk {k}; only tensors can be sent between stages")
            g.output(tuple(env[v] for v in out_vals))
        sub = fx.GraphModule(gm, g)
        params = sorted({n.target for n in g.nodes if n.op == "get_attr"})
        chunk_units = [names[u] for u, c in enumerate(chunk_of_unit) if c == k]
        chunks.append(Chunk(k, sub, [v.name for v in carried], [v.name for v in out_vals],
                            [placeholders.index(a) for a in used_batch], chunk_units,
                            sum(costs[u] for u, c in enumerate(chunk_of_unit) if c == k), params,
                            [v in needs_grad for v in out_vals]))
        carried = out_vals
    return chunks


def param_holders(chunks: Sequence[Chunk], p: int) -> Dict[str, Tuple[int, ...]]:
    """Parameter name -> the pipeline ranks whose chunks use it (chunk c lives on rank c % p),
    in rank order. A tied embedding and LM head has two."""
    ranks: Dict[str, set] = {}
    for c in chunks:
        for name in c.params:
            ranks.setdefault(name, set()).add(c.index % p)
    return {n: tuple(sorted(r)) for n, r in ranks.items()}
