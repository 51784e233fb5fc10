"""Writing a compiled folder: each rank's chunks (and the token counter) as the source of
``stage.py`` (``stage_source``), its weights as safetensors, and the manifest (``write_folder``).

``stage.py`` imports torch and fxmegatron only, never the original model's code. The
collectives in the generated code name their group symbolically ("@tp"), which
``load_folder`` binds to the launching job's process group.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import textwrap
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from safetensors.torch import save_file

from fxmegatron.errors import CompiledFolderError
from fxmegatron.io.stage_folder.check import FORMAT, MANIFEST, file_sha256
from fxmegatron.lower.materialize import is_module
from fxmegatron.ops.dropout import DropoutRng
from fxmegatron.passes.recompute import Recomputed
from fxmegatron.placement import layout_to_json


# ---- emitting source --------------------------------------------------------------------
def _import_line(name: str, obj) -> Optional[str]:
    if name in ("torch", "fx_pytree", "pytree"):
        return {"torch": "import torch", "fx_pytree": "import torch.fx._pytree as fx_pytree",
                "pytree": "import torch.utils._pytree as pytree"}[name]
    if name in ("inf", "nan"):
        return f"from math import {name}"
    if name == "NoneType":
        return "NoneType = type(None)"
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if mod and qual and "." not in qual and "<" not in qual:
        return f"from {mod} import {qual} as {name}" if qual != name else f"from {mod} import {qual}"
    raise CompiledFolderError(f"cannot import {name!r} ({obj!r}) in generated code")


class _Emitter:
    """Turns a GraphModule (and the GraphModules inside it) into class definitions."""

    def __init__(self, group_names: Dict[str, str]):
        self.group_names = group_names      # runtime group name -> symbolic name ("@tp")
        self.imports: List[str] = []
        self.classes: List[str] = []
        self.count = 0

    def _symbolic_code(self, gm: fx.GraphModule):
        """``gm``'s code with group names made symbolic ("@tp"), from a copy of its graph: the
        live model keeps its own groups."""
        g = fx.Graph()
        g._codegen = copy.deepcopy(gm.graph._codegen)
        g.output(g.graph_copy(gm.graph, {}))
        for n in g.nodes:
            if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("fxmegatron"):
                n.args = tuple(self.group_names.get(a, a) if isinstance(a, str) else a for a in n.args)
        return g.python_code(root_module="self")

    def emit(self, gm: fx.GraphModule, cls: str) -> str:
        """Class ``cls`` for ``gm``; returns the expression that builds it from ``tensors``."""
        code = self._symbolic_code(gm)
        for name, obj in code.globals.items():
            line = _import_line(name, obj)
            if line not in self.imports:
                self.imports.append(line)
        init = ["    def __init__(self, tensors):", "        super().__init__()"]
        seen = set()
        for n in gm.graph.nodes:
            if n.op not in ("get_attr", "call_module") or n.target in seen:
                continue
            seen.add(n.target)
            obj = gm.get_submodule(n.target) if n.op == "call_module" or is_module(gm, n.target) else None
            if obj is None:
                init.append(f"        attach(self, {n.target!r}, tensors[{n.target!r}])")
            else:
                init.append(f"        attach(self, {n.target!r}, {self._module_expr(obj, cls, n.target)})")
        body = "\n".join(init) + "\n" + textwrap.indent(code.src.strip("\n"), "    ") + "\n"
        self.classes.append(f"class {cls}(torch.nn.Module):\n{body}\n")
        return f"{cls}(tensors)"

    def _module_expr(self, obj, owner: str, target: str) -> str:
        self.count += 1
        sub = f"{owner}_{target.replace('.', '_')}"
        if isinstance(obj, Recomputed):
            self._need("from fxmegatron.passes.recompute import Recomputed")
            return f"Recomputed({self.emit(obj.body, sub)}, {obj.label!r})"
        if isinstance(obj, DropoutRng):
            self._need("from fxmegatron.ops.dropout import DropoutRng")
            return f"DropoutRng({obj.seed})"
        if isinstance(obj, fx.GraphModule):
            return self.emit(obj, sub)
        raise CompiledFolderError(f"submodule {target} ({type(obj).__name__}) has no generated form")

    def _need(self, line):
        if line not in self.imports:
            self.imports.append(line)


def stage_source(modules: Dict[int, fx.GraphModule], group_names: Dict[str, str],
                 counter: Optional[fx.GraphModule] = None) -> str:
    em = _Emitter(group_names)
    em._need("import torch")
    em._need("from fxmegatron.io.stage_folder import attach")
    for k, gm in sorted(modules.items()):
        em.emit(gm, f"Chunk{k}")
    if counter is not None:
        em.emit(counter, "CountTokens")
    head = ('"""Generated by fxmegatron: this rank\'s pipeline chunks. Each ChunkK(tensors) takes its\n'
            'weights by name (see weights.safetensors) and runs forward(*boundary_inputs, *batch_inputs);\n'
            'CountTokens({}) maps a microbatch to the labels its loss averages over, counted where they\n'
            'are not the manifest\'s count_ignore (microbatches and replicas are weighted by them)."""\n')
    return head + "\n".join(em.imports) + "\n\n\n" + "\n\n".join(em.classes)


# ---- writing ---------------------------------------------------------------------------------
def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def write_folder(pm, folder: str) -> None:
    """Write this rank's stage (call on every rank of data-parallel replica 0); ``pm`` is a
    ``ParallelModel`` (or anything with a ``program``) in the chunked form."""
    prog = pm.program
    pipe = prog.pipeline
    if pipe is None:
        raise CompiledFolderError("write_folder needs the chunked form: parallelize(..., virtual_stages>=1) "
                                  "with pp > 1, or compile_model, which always builds it")
    groups = {prog.axes[dim].group_name: "@" + dim for dim in ("tp", "pp", "dp") if prog.axes[dim].group_name}
    pp_rank, tp_rank = prog.rank("pp"), prog.rank("tp")
    rank_dir = f"pp{pp_rank}-tp{tp_rank}"
    os.makedirs(os.path.join(folder, rank_dir), exist_ok=True)
    # bytes, not text: the hash must be of exactly what lands on disk, whatever the locale
    counter = getattr(prog.token_count, "graph", None)
    src = stage_source(pipe.stage.modules, groups, counter).encode("utf-8")
    with open(os.path.join(folder, rank_dir, "stage.py"), "wb") as f:
        f.write(src)
    written = {f"{rank_dir}/stage.py": hashlib.sha256(src).hexdigest()}
    tensors = {}
    for k, mod in pipe.stage.modules.items():
        for n in mod.graph.nodes:
            if n.op == "get_attr" and not is_module(mod, n.target):
                t = _get(mod, n.target)
                tensors[n.target] = t.detach().contiguous().cpu()
    weights = os.path.join(folder, rank_dir, "weights.safetensors")
    save_file(tensors, weights, metadata={"parameters": json.dumps(sorted(pipe.stage.params))})
    written[f"{rank_dir}/weights.safetensors"] = file_sha256(weights)
    files = _gather_files(prog, written)
    if pp_rank == 0 and tp_rank == 0:
        sched = pipe.schedule
        manifest = {
            "format": FORMAT,
            "layout": {"pp": prog.size("pp"), "tp": prog.size("tp")},
            "schedule": sched.name, "virtual_stages": sched.v, "microbatches": sched.m,
            "in_spec": pytree.treespec_dumps(prog.in_spec),
            "batch": [{"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for v in prog.example_inputs],
            "input_names": list(prog.input_names),
            "seed": prog.seed,
            "aliases": dict(prog.aliases),
            "params": [{"name": n, "shape": list(prog.global_params[n][0]),
                        "dtype": _dtype_name(prog.global_params[n][1]),
                        "layout": layout_to_json(prog.param_layout(n))} for n in prog.param_order],
            "sequence_parallel": prog.sequence_parallel,
            "recompute": prog.recompute,
            "chunks": [{"index": c.index, "units": c.units, "cost": c.cost, "params": c.params,
                        "batch_inputs": c.batch_inputs, "boundary_in": c.boundary_in,
                        "boundary_out": c.boundary_out, "boundary_grad": c.boundary_grad}
                       for c in pipe.chunks],
            "specs": {str(k): [{"shape": list(s.shape), "dtype": _dtype_name(s.dtype), "grad": s.grad,
                                "eval_shape": None if s.eval_shape is None else list(s.eval_shape)}
                               for s in v] for k, v in pipe.specs.items()},
            "shared": {n: {"shape": list(s), "dtype": _dtype_name(d)} for n, (s, d) in pipe.stage.shared.items()},
            "count_ignore": None if counter is None else prog.token_count.ignore,
            "files": dict(sorted(files.items())),
        }
        # written whole or not at all, and last: a folder whose writing stopped midway has no
        # manifest, or an old one whose hashes do not match
        tmp = os.path.join(folder, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(folder, MANIFEST))


def _gather_files(prog, written: Dict[str, str]) -> Dict[str, str]:
    """Every writing rank's {relative path: SHA-256}: rank (pp 0, tp 0) writes the manifest,
    and each rank hashed only its own files, as it wrote them. Over the tp group, then the pp
    group: both lie within data-parallel replica 0, the only ranks that call ``write_folder``."""
    files = dict(written)
    for dim in ("tp", "pp"):
        axis = prog.axes[dim]
        if axis.size > 1:
            parts: List[Optional[Dict[str, str]]] = [None] * axis.size
            dist.all_gather_object(parts, files, group=axis.group)
            files = {k: v for part in parts for k, v in part.items()}
    return files


def _get(mod, target):
    obj = mod
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
