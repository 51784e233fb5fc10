"""Write a transformed graph as readable files: code, placements, collectives, decisions."""
from __future__ import annotations

import os
from typing import Dict

import torch
import torch.fx as fx

from fxmegatron.capture import module_path
from fxmegatron.ops.registry import record
from fxmegatron.placement import PLACEMENTS, placed


def collective_nodes(gm: fx.GraphModule):
    """(node, short name) for every node that communicates, in graph order: the nodes whose
    target has a record in ``ops.registry`` and whose call communicates (an FP8 op over no
    group does not)."""
    out = []
    for n in gm.graph.nodes:
        rec = record(n.target) if n.op == "call_function" else None
        if rec is not None and rec.communicates(n.args):
            out.append((n, rec.label))
    return out


def _shape(v):
    if isinstance(v, torch.Tensor):
        return "x".join(str(s) for s in v.shape) or "scalar"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_shape(x) for x in v) + ")"
    return ""


def _plc(p):
    if isinstance(p, tuple):
        return "(" + ", ".join(str(x) for x in p) + ")"
    return "" if p is None else str(p)


def _target(n):
    t = n.target
    return getattr(t, "__name__", str(t)) if callable(t) else str(t)


def placement_table(gm: fx.GraphModule) -> str:
    """One row per node: its placement and the tensor-parallel rule that placed it."""
    rows = [("node", "op", "placement", "rule", "cp", "local shape", "module", "note")]
    for n in gm.graph.nodes:
        if n.op in ("output",):
            continue
        note = n.meta.get("tp_decision") or ""
        if n.meta.get("recompute"):
            note = (note + " " if note else "") + f"[recompute: {n.meta['recompute']}]"
        if n.meta.get("fp8"):
            note = (note + " " if note else "") + f"[{n.meta['fp8']}]"
        rows.append((n.name, _target(n) if n.op != "placeholder" else "input", _plc(placed(n, "tp")),
                     n.meta.get("tp_rule", ""), _plc(placed(n, "cp")), _shape(n.meta.get("val")),
                     module_path(n), note))
    k = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(k)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(k)) + "  " + r[k] for r in rows) + "\n"


def write_dump(directory: str, gm: fx.GraphModule, info: Dict[str, str]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "graph.py"), "w") as f:
        f.write("# Transformed graph of one rank: parameters are this rank's local shards.\n")
        f.write("# Collectives: copy_to_tp (f), reduce_from_tp (g), vocab_parallel_cross_entropy.\n")
        f.write(gm.code)
    for name, mod in gm.named_children():
        body = getattr(mod, "body", None)
        if isinstance(body, fx.GraphModule):
            with open(os.path.join(directory, f"{name}.py"), "w") as f:
                f.write(f"# {getattr(mod, 'label', '')} recomputation: this body runs in forward without\n"
                        "# keeping its activations and runs again in backward.\n")
                f.write(body.code)
    for name, mod in gm.named_modules():
        if hasattr(mod, "kernel") and hasattr(mod, "source"):     # a fused elementwise group
            with open(os.path.join(directory, f"{name.replace('.', '_')}.triton.py"), "w") as f:
                f.write("# generated Triton kernels of a fused elementwise group: forward, and a backward\n"
                        "# that recomputes the chain from the group's inputs\n")
                f.write(mod.source())
    with open(os.path.join(directory, "placements.txt"), "w") as f:
        f.write("# R = replicated, S(d) = split along dim d, P(sum) = partial sums (reduced by g);\n"
                "# rule: the tensor-parallel placement rule that placed the node (fxmegatron/passes/\n"
                "# tensor_parallel/rules/<file>.<rule>; opaque: replicated, with why);\n"
                "# cp: context parallelism's placement (S(d, seq): this rank's chunks of the sequence in dim d,\n"
                "# R(seq@d): whole, its sequence in dim d; R: whole; P(sum): a partial sum over cp)\n")
        f.write(placement_table(gm))
    with open(os.path.join(directory, "collectives.txt"), "w") as f:
        for n, kind in collective_nodes(gm):
            f.write(f"{n.name:32s} {kind:48s} {module_path(n)}\n")
            detail = record(n.target).detail
            if detail is not None:      # cp attention: the ring's steps
                f.write("".join(f"    {line}\n" for line in detail(n.args).splitlines()))
    with open(os.path.join(directory, "plan.txt"), "w") as f:
        for k, v in info.items():
            f.write(f"{k}: {v}\n")
        f.write("\n# decisions (matmuls, embeddings, losses)\n")
        for n in gm.graph.nodes:
            if "tp_decision" in n.meta:
                f.write(f"{n.name:24s} {module_path(n):40s} {n.meta['tp_decision']}\n")
        fp8 = [n for n in gm.graph.nodes if "fp8" in n.meta]
        if fp8:
            f.write("\n# precision of the linear layers (the fp8 pass: FP8, or what they keep and why)\n")
            for n in fp8:
                f.write(f"{n.name:24s} {module_path(n):40s} {n.meta['fp8']}\n")
        f.write("\n# parameters\n")
        for n in gm.graph.nodes:
            if n.op == "get_attr" and "tp" in n.meta.get(PLACEMENTS, {}):
                f.write(f"{n.target:56s} {_plc(placed(n, 'tp')):20s} {_shape(n.meta.get('val'))}\n")


def dump_program(directory: str, program, rank: int) -> None:
    """Write one rank's program (a ``fxmegatron.program.RankProgram``) under
    ``directory/rank{rank}``: its graph, or each of its pipeline chunks, with the layout
    and the decisions that made it."""
    ax = program.axes
    info = {dim: f"{ax[dim].size} (rank {ax[dim].rank})" for dim in ("dp", "tp", "pp", "cp") if dim in ax}
    info.update({"sequence parallel": str(program.sequence_parallel), "recompute": program.recompute,
                 "microbatches": str(program.microbatches),
                 "planning attempts": str(program.planning_attempts)})
    for name, why in program.replicated.items():
        info[f"kept replicated: {name}"] = why
    if program.coverage is not None:
        info["split"] = program.coverage.summary(top=10)
    for i, note in enumerate(program.notes):
        info[f"capture note {i}"] = note
    root = f"{directory}/rank{rank}"
    pipe = program.pipeline
    if pipe is None:
        write_dump(root, program.graph_module, info)
        return
    sched = pipe.schedule
    info["schedule"] = f"{sched.name} p={sched.p} v={sched.v} m={sched.m}"
    for c in pipe.chunks:
        info[f"chunk {c.index}"] = (f"rank {c.index % sched.p}; units {c.units[0]} .. {c.units[-1]} "
                                    f"({len(c.units)}); cost {c.cost:.3g}; sends {c.boundary_out}")
    info["actions"] = " ".join(str(a) for a in sched.ranks[ax["pp"].rank])
    for k, mod in pipe.stage.modules.items():
        write_dump(f"{root}/chunk{k}", mod, info)
