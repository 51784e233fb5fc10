"""What FP8 does to each linear's operands, on request: ``ParallelModel.fp8_report(batch)``.

One forward of the rank's graph (no grad) in which every ``fp8_linear`` call also quantises
its input and weight as the op does (the recipe, the tp group's amax) and compares the
dequantised values with the originals. Per linear: the amax of x and of w, how much of each
the FP8 format flushes to zero (elements not zero that quantise to 0: underflow, the risk of
a scale set by one large outlier), how much lands on the format's largest value
(saturation: with a scale from the current amax only the amax itself does), and the
relative error of the dequantised operand. The backward's operand ``dy`` is not covered.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.ops.fp8 import E4M3, fp8_linear, quantize, recipe_of
from fxmegatron.ops.fp8_operands import fp8_linear_q


def _stats(t: torch.Tensor, recipe: str, group: str) -> Dict[str, float]:
    q, scale = quantize(t, recipe, E4M3, group)
    t2 = t.reshape(-1, t.shape[-1]).float()
    back = q.float() * scale
    nonzero = t2 != 0
    top = torch.finfo(E4M3).max
    return {
        "amax": float(t2.abs().max()),
        "underflow": float(((q.float() == 0) & nonzero).sum()) / max(t2.numel(), 1),
        "saturated": float((q.float().abs() == top).sum()) / max(t2.numel(), 1),
        "rel_error": float((back - t2).norm() / t2.norm().clamp(min=1e-30)),
    }


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.rows: List[dict] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op == "call_function" and n.target in (fp8_linear, fp8_linear_q):     # same first six args
            x, w = self.env[n.args[0]], self.env[n.args[1]]
            recipe, group = n.args[3], n.args[4]
            self.rows.append({"node": n.name, "module": module_path(n), "recipe": recipe_of(recipe).name,
                              "x": _stats(x, recipe, group), "w": _stats(w, recipe, group)})
        return out

    def call_module(self, target, args, kwargs):
        body = getattr(self.module.get_submodule(target), "body", None)
        if isinstance(body, fx.GraphModule):        # a recomputed region: its linears are listed too
            inner = _Recorder(body)
            out = inner.run(*args)
            self.rows.extend(inner.rows)
            return out
        return super().call_module(target, args, kwargs)


def fp8_report(gm: fx.GraphModule, flat_inputs) -> List[dict]:
    """One row per ``fp8_linear`` of ``gm``, in graph order, from one forward on ``flat_inputs``
    (the caller holds no-grad and eval mode)."""
    rec = _Recorder(gm)
    rec.run(*flat_inputs)
    return rec.rows


def format_report(rows: List[dict]) -> str:
    """The report as a table, one line per linear."""
    head = (f"{'module':44s} {'recipe':10s} {'amax x':>9s} {'amax w':>9s} {'x flushed':>9s} {'w flushed':>9s} "
            f"{'x err':>8s} {'w err':>8s}")
    lines = [head]
    for r in rows:
        x, w = r["x"], r["w"]
        lines.append(f"{r['module'][:44]:44s} {r['recipe']:10s} {x['amax']:9.3g} {w['amax']:9.3g} "
                     f"{x['underflow']:9.2%} {w['underflow']:9.2%} {x['rel_error']:8.2e} {w['rel_error']:8.2e}")
    return "\n".join(lines) + "\n"
