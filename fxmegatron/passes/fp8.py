"""FP8 linear layers as a graph transformation: matmuls against a parameter become
``fp8_linear`` (``fxmegatron.ops.fp8``: e4m3/e5m2 GEMMs with dynamic scales, forward and
backward, as the recipe says; the weights keep their high-precision masters).

A matmul is a candidate when it computes a linear layer against a parameter, whatever ATen
op the model's code became: ``linear(x, W, b)``, ``addmm(b, x, B)``, ``mm(x, B)`` or
``matmul(x, B)`` where ``B`` is a parameter used as [in, out] (HF GPT-2's Conv1D) or its
transpose, through ``t``/``.T``/``transpose``/``permute`` nodes (``x @ W.T``: Falcon). A candidate becomes FP8 when:

* the policy selects its module path (``FP8Policy``);
* it is not the LM head: the matmul whose output reaches the loss through no other matmul,
  or one whose weight an embedding also reads (``FP8Policy(lm_head=True)`` includes it);
* its GEMM dims are multiples of 16, as ``torch._scaled_mm`` requires of all three GEMMs:
  in and out features, and tokens (the contraction dim of the weight gradient);
* its input is a floating tensor of at most 32 bits, and an addmm's bias is one row.

Every candidate records the outcome in ``meta["fp8"]``: "fp8 tensorwise", or the dtype it
keeps and why ("bf16: lm head (feeds the loss)"); ``gm.meta[FP8_REPORT]`` lists them all.
A policy that selects no candidate at all is an error.

The pass runs before or after the tensor-parallel rewrite. After it, ``tp_group`` names the
tp axis ("@tp", bound by materialisation) and each node's placements (``placed(node, "tp")``,
left by the rewrite) say which GEMM dim the ranks split: a weight split along out features
(column-parallel) or in features (row-parallel), or a replicated weight whose input is
split along tokens (sequence shards). ``fp8_linear`` needs that to reduce its amaxes so that
the result does not depend on tp (see ``fxmegatron.ops.fp8``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.errors import PrecisionError
from fxmegatron.ops.fp8 import fp8_linear, recipe_of
from fxmegatron.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding
from fxmegatron.passes.node_meta import is_parameter
from fxmegatron.placement import Shard, placed

aten = torch.ops.aten
FP8_REPORT = "fxmegatron/fp8"      # gm.meta key: [(module path, node name, outcome)]
ALIGN = 16
MATMULS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}
LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
          vocab_parallel_cross_entropy}
EMBEDDINGS = {aten.embedding.default, vocab_parallel_embedding}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}

# Module-path vocabulary of "attention" and "mlp": a path segment that names the block's part.
# These are the names Hugging Face and most model code give those modules (attn, self_attn,
# attention, self_attention; mlp, feed_forward, ffn, block_sparse_moe, experts): the user's
# vocabulary for a policy, read from paths; no op or shape is treated differently by them.
ATTENTION = r"(?i)(^|\.)[^.]*(attn|attention)[^.]*(\.|$)"
MLP = r"(?i)(^|\.)[^.]*(mlp|feed_forward|ffn|moe|expert)[^.]*(\.|$)"


@dataclass(frozen=True)
class FP8Policy:
    """Which linears run in FP8: those whose module path matches one of ``modules`` (regular
    expressions, ``re.search``; empty: every linear). The LM head only with ``lm_head``."""

    modules: Tuple[str, ...] = ()
    lm_head: bool = False
    name: str = "all"

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(self.modules))
        for p in self.modules:
            try:
                re.compile(p)
            except re.error as exc:
                raise PrecisionError(f"FP8 policy {self.name!r}: {p!r} is not a regular expression ({exc})") from None

    @staticmethod
    def of(mode: Union[None, str, Sequence[str], "FP8Policy"]) -> "FP8Policy":
        if isinstance(mode, FP8Policy):
            return mode
        if mode is None or mode == "all":
            return FP8Policy()
        if mode == "attention":
            return FP8Policy(modules=(ATTENTION,), name="attention")
        if mode == "mlp":
            return FP8Policy(modules=(MLP,), name="mlp")
        if isinstance(mode, (list, tuple)) and mode and all(isinstance(p, str) for p in mode):
            return FP8Policy(modules=tuple(mode), name="regex " + ", ".join(mode))
        raise PrecisionError(f"fp8 policy {mode!r}: expected 'all', 'attention', 'mlp', a list of module-path "
                             "regular expressions or an FP8Policy")

    def selects(self, path: str) -> bool:
        return not self.modules or any(re.search(p, path) for p in self.modules)


@dataclass
class _Linear:
    node: fx.Node
    x: fx.Node
    param: fx.Node           # the get_attr of the weight
    transposed: bool         # the parameter is stored [in, out]: the linear's weight is its transpose
    bias: Optional[fx.Node]
    why_not: str = ""        # a candidate that cannot be rewritten, and why


def _through_transposes(n) -> Tuple[object, int]:
    """(node under any chain of 2-D transposes, how many there were)."""
    flips = 0
    while isinstance(n, fx.Node) and n.op == "call_function":
        if n.target in (aten.t.default, aten.numpy_T.default):     # numpy_T: ``.T`` (Falcon's linears)
            pass
        elif n.target is aten.transpose.int and sorted(d % 2 for d in n.args[1:3]) == [0, 1]:
            pass
        elif n.target is aten.permute.default and list(n.args[1]) in ([1, 0], [-1, -2]):
            pass
        else:
            break
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() != 2:
            break
        flips += 1
        n = n.args[0]
    return n, flips


def _as_linear(gm: fx.GraphModule, n: fx.Node) -> Optional[_Linear]:
    """The linear layer ``n`` computes against a parameter, or None."""
    if n.op != "call_function" or n.target not in MATMULS:
        return None
    if n.target is aten.linear.default:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        p, flips = _through_transposes(w)
        stored_in_out = flips % 2 == 1
    else:
        if n.target is aten.addmm.default:
            b, x, w = n.args[0], n.args[1], n.args[2]
        else:
            b, (x, w) = None, n.args[:2]
        p, flips = _through_transposes(w)
        stored_in_out = flips % 2 == 0      # mm's right operand is [in, out]
    pv = p.meta.get("val") if isinstance(p, fx.Node) else None
    if not is_parameter(gm, p) or (isinstance(pv, torch.Tensor) and pv.dim() != 2):
        return None
    lin = _Linear(n, x, p, stored_in_out, b)
    if n.target is aten.addmm.default:
        bv = b.meta.get("val") if isinstance(b, fx.Node) else None
        if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            lin.why_not = "addmm with alpha/beta"
        elif not (isinstance(bv, torch.Tensor) and bv.dim() == 1):
            lin.why_not = "addmm whose bias is not one row"
    return lin


def _loss_heads(gm: fx.GraphModule, linears: Dict[fx.Node, _Linear]) -> set:
    """The matmuls whose output reaches a loss's logits through no other matmul."""
    heads, seen = set(), set()
    todo = [n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target in LOSSES and n.args]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in MATMULS:
            heads.add(n)
            continue
        todo.extend(n.all_input_nodes)
    return {n for n in heads if n in linears}


def _embedded(gm: fx.GraphModule) -> set:
    """Parameters an embedding reads (a weight tied to it is the LM head's)."""
    return {n.args[0].target for n in gm.graph.nodes
            if n.op == "call_function" and n.target in EMBEDDINGS and isinstance(n.args[0], fx.Node)}


def _split(lin: _Linear) -> str:
    """Which GEMM dim the tp ranks hold different slices of (from the rewrite's placements)."""
    plc = placed(lin.param, "tp")
    if isinstance(plc, Shard):
        out_dim = 1 if lin.transposed else 0
        return "out" if plc.dim % 2 == out_dim else "in"
    xp = placed(lin.x, "tp")
    xv = lin.x.meta.get("val")
    if isinstance(xp, Shard) and isinstance(xv, torch.Tensor) and xp.dim % xv.dim() != xv.dim() - 1:
        return "tokens"
    return ""


def _blocker(lin: _Linear, policy: FP8Policy, head: str) -> str:
    """Why the linear stays in high precision ("" when it can be FP8)."""
    if lin.why_not:
        return lin.why_not
    if head and not policy.lm_head:
        return f"lm head ({head})"
    xv, wv = lin.x.meta.get("val"), lin.param.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)):
        return "no shapes in meta['val']"
    if not xv.is_floating_point() or xv.dtype == torch.float64 or xv.dim() < 2:
        return f"input {xv.dtype} of {xv.dim()} dims"
    n, k = (wv.shape[1], wv.shape[0]) if lin.transposed else (wv.shape[0], wv.shape[1])
    m = xv.numel() // max(k, 1)
    for what, size in (("in features", k), ("out features", n), ("tokens", m)):
        if size % ALIGN:
            return f"{what} {size} not a multiple of {ALIGN} (FP8 GEMM alignment)"
    return ""


def _rewrite(gm: fx.GraphModule, lin: _Linear, recipe: str, tp_group: str, outcome: str) -> fx.Node:
    g, node = gm.graph, lin.node
    with g.inserting_before(node):
        w = lin.param
        if lin.transposed:
            w = g.call_function(aten.t.default, (lin.param,))
            w.meta.update({k: v for k, v in lin.param.meta.items() if k != "val"})
            if isinstance(lin.param.meta.get("val"), torch.Tensor):
                w.meta["val"] = lin.param.meta["val"].t()
        new = g.call_function(fp8_linear, (lin.x, w, lin.bias, recipe, tp_group, _split(lin)))
    new.meta.update(node.meta)
    new.meta["fp8"] = outcome
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new


def apply_fp8(gm: fx.GraphModule, policy="all", recipe: str = "tensorwise", tp_group: str = "") -> fx.GraphModule:
    """Rewrite the linears the policy selects into ``fp8_linear`` (see the module docstring)."""
    policy = FP8Policy.of(policy)
    recipe = recipe_of(recipe).name
    linears = {n: lin for n in gm.graph.nodes if (lin := _as_linear(gm, n)) is not None}
    heads = _loss_heads(gm, linears)
    tied = _embedded(gm)
    report: List[Tuple[str, str, str]] = []
    chosen = 0
    for node, lin in linears.items():
        path = module_path(node)
        if not policy.selects(path):
            continue
        chosen += 1
        head = "feeds the loss" if node in heads else ("weight tied to an embedding" if lin.param.target in tied
                                                       else "")
        why = _blocker(lin, policy, head)
        xv = lin.x.meta.get("val")
        if why:
            keep = _SHORT.get(getattr(xv, "dtype", None), "unchanged")
            node.meta["fp8"] = f"{keep}: {why}"
        else:
            node = _rewrite(gm, lin, recipe, tp_group, f"fp8 {recipe}")
        report.append((path, node.name, node.meta["fp8"]))
    if not chosen:
        paths = sorted({module_path(n) or n.name for n in linears})
        raise PrecisionError(f"FP8 policy {policy.name!r} selects none of the {len(paths)} linear layers of the graph"
                             + (f" ({', '.join(paths[:6])}{', ...' if len(paths) > 6 else ''})" if paths else ""))
    gm.meta[FP8_REPORT] = report
    gm.graph.lint()
    gm.recompile()
    return gm
