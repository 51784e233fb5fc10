"""What FP8 does to each linear's operands, on request: ``ParallelModel.fp8_report(batch)``.

One forward of the rank's graph in which every FP8 linear also quantises its input and weight
as the op does (the recipe, the tp group's amax) and compares the dequantised values with the
originals, then one ``torch.autograd.grad`` of the loss with respect to the linears' outputs
(no parameter's ``.grad`` is touched) for the backward's operand ``dy``, quantised in the
recipe's gradient format (e5m2 tensorwise, e4m3 rowwise). Per linear: the amax of x, w and dy
(under tensor parallelism, over the group: the whole operand's, which sets the scale), and, of
this rank's part of each, how much the FP8 format flushes to zero (elements not zero that quantise to 0: underflow, the risk of
a scale set by one large outlier), how much lands on the format's largest value
(saturation: with a scale from the current amax only the amax itself does), and the
relative error of the dequantised operand.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.ops.collectives import all_gather_seq, all_reduce, gather_seq
from fxmegatron.ops.fp8 import E4M3, amax_group, fp8_linear, quantize, recipe_of
from fxmegatron.ops.fp8_gather import fp8_gathered_input, fp8_gathered_whole_input
from fxmegatron.ops.fp8_operands import fp8_linear_q


def _stats(t: torch.Tensor, recipe: str, group: str, split: str, rows: str, dtype=E4M3) -> Dict[str, float]:
    """``t``'s amax over the tp group (the whole operand's), and what quantising it as the op
    does (``rows``: the GEMM dim its rows index, for the amax groups) does to this rank's part."""
    q, scale = quantize(t, recipe, dtype, amax_group(recipe_of(recipe), group, split, rows))
    t2 = t.reshape(-1, t.shape[-1]).float()
    back = q.float() * scale
    nonzero = t2 != 0
    top = torch.finfo(dtype).max
    amax = t2.abs().max().reshape(1)
    return {
        "amax": float(all_reduce(amax, "max", group) if group else amax),
        "underflow": float(((q.float() == 0) & nonzero).sum()) / max(t2.numel(), 1),
        "saturated": float((q.float().abs() == top).sum()) / max(t2.numel(), 1),
        "rel_error": float((back - t2).norm() / t2.norm().clamp(min=1e-30)),
    }


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.rows: List[dict] = []
        self.outputs: List[torch.Tensor] = []       # each row's linear output, for its dy

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target in (fp8_gathered_input, fp8_gathered_whole_input):
            # the linears' x as the model has it (the program gathers it only in FP8)
            gather = gather_seq if n.target is fp8_gathered_input else all_gather_seq
            return gather(*self.fetch_args_kwargs_from_env(n)[0])
        out = super().run_node(n)
        if n.op == "call_function" and n.target in (fp8_linear, fp8_linear_q):     # same first six args
            x, w = self.env[n.args[0]], self.env[n.args[1]]
            recipe, group, split = n.args[3], n.args[4], n.args[5]
            with torch.no_grad():
                self.rows.append({"node": n.name, "module": module_path(n), "recipe": recipe_of(recipe).name,
                                  "group": (group, split), "x": _stats(x, recipe, group, split, "tokens"),
                                  "w": _stats(w, recipe, group, split, "out")})
            self.outputs.append(out)
        return out

    def call_module(self, target, args, kwargs):
        body = getattr(self.module.get_submodule(target), "body", None)
        if isinstance(body, fx.GraphModule):        # a recomputed region: its linears are listed too
            inner = _Recorder(body)
            out = inner.run(*args)
            self.rows.extend(inner.rows)
            self.outputs.extend(inner.outputs)
            return out
        return super().call_module(target, args, kwargs)


def fp8_report(gm: fx.GraphModule, flat_inputs) -> List[dict]:
    """One row per FP8 linear of ``gm``, in graph order, from one forward and one gradient of
    its loss on ``flat_inputs`` (the caller holds eval mode; grad is enabled here)."""
    rec = _Recorder(gm)
    with torch.enable_grad():
        out = rec.run(*flat_inputs)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        outs = [o for o in rec.outputs if o.requires_grad]
        dys = dict(zip(map(id, outs), torch.autograd.grad(loss, outs, allow_unused=True))) if outs and \
            loss.requires_grad else {}
    for row, o in zip(rec.rows, rec.outputs):
        dy = dys.get(id(o))
        r = recipe_of(row["recipe"])
        row["dy"] = _stats(dy, r, *row.pop("group"), "tokens", r.grad_dtype) if dy is not None else None
    return rec.rows


def format_report(rows: List[dict]) -> str:
    """The report as a table, one line per linear."""
    head = (f"{'module':40s} {'recipe':10s} {'amax x':>9s} {'amax w':>9s} {'amax dy':>9s} {'x flushed':>9s} "
            f"{'w flushed':>9s} {'dy flushed':>10s} {'x err':>8s} {'w err':>8s} {'dy err':>8s}")
    lines = [head]
    for r in rows:
        x, w, dy = r["x"], r["w"], r["dy"] or {"amax": float("nan"), "underflow": float("nan"),
                                                 "rel_error": float("nan")}
        lines.append(f"{r['module'][:40]:40s} {r['recipe']:10s} {x['amax']:9.3g} {w['amax']:9.3g} {dy['amax']:9.3g} "
                     f"{x['underflow']:9.2%} {w['underflow']:9.2%} {dy['underflow']:10.2%} {x['rel_error']:8.2e} "
                     f"{w['rel_error']:8.2e} {dy['rel_error']:8.2e}")
    return "\n".join(lines) + "\n"
