"""Generated stage modules: each rank's chunks as Python source plus safetensors weights.

``write_folder(pm, folder)`` (one call per (pp, tp) rank, data-parallel replica 0)
writes::

    FOLDER/manifest.json                 layout, schedule, chunks, boundaries, placements, file hashes
    FOLDER/pp{p}-tp{t}/stage.py          class Chunk{k}(nn.Module) per chunk: readable forward code
    FOLDER/pp{p}-tp{t}/weights.safetensors

``stage.py`` imports torch and fxmegatron only, never the original model's code.
The weights are safetensors, loaded with no pickles. The collectives in the
generated code name their group symbolically ("@tp"), and ``load_folder``
binds that name to the launching job's process group in the source it loads.

A compiled folder is code: ``load_folder`` executes its ``stage.py`` files. The manifest
records the SHA-256 of every file written with it, and ``check_folder`` (which
``load_folder`` and ``fxmegatron.launch`` call before they import or read anything) refuses
a folder whose files changed after they were written, are missing, or were joined by a .py
file. That catches a corrupt copy or a hand edit, not a
malicious author: whoever can rewrite the files can rewrite the manifest too.
"""
from __future__ import annotations

import copy
import hashlib
import json
import textwrap
import os
import types
from typing import Dict, List, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from safetensors import safe_open
from safetensors.torch import save_file

from fxmegatron.errors import CompiledFolderError
from fxmegatron.passes.recompute import Recomputed
from fxmegatron.ops.dropout import DropoutRng
from fxmegatron.compiler import DP_SEED_STRIDE
from fxmegatron.placement import placement_from_json, placement_to_json
from fxmegatron.lower.materialize import is_module

MANIFEST = "manifest.json"
FORMAT = "fxmegatron-compiled/2"       # /2: the manifest records every file's SHA-256
_HASH_BLOCK = 1 << 20

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


def attach(root: nn.Module, path: str, value) -> None:
    """Set ``root.<path>`` creating plain containers on the way (``layers.0.weight``)."""
    *parents, last = path.split(".")
    mod = root
    for p in parents:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Module):
        mod.add_module(last, value)
    elif isinstance(value, nn.Parameter):
        mod.register_parameter(last, value)
    else:
        mod.register_buffer(last, value)


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
                        "placement": placement_to_json(prog.placements.get(n))} for n in prog.param_order],
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


# ---- checking --------------------------------------------------------------------------------
def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


class CheckedFolder(NamedTuple):
    """A folder whose files ``check_folder`` found as written, and its manifest: pass it to
    ``load_folder`` so the files are hashed once."""
    path: str
    manifest: dict


_TRUST = "a compiled folder is code (launch executes its stage.py files): only run folders you trust"


def check_folder(folder: str) -> CheckedFolder:
    """Refuse ``folder`` unless every file its manifest records is there with the recorded
    SHA-256, and no rank directory holds a .py file the manifest does not record. Reads the
    files as bytes; imports nothing."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CompiledFolderError(f"{folder} has no {MANIFEST}: not a folder written by `fxmegatron compile`")
    try:
        with open(path) as f:
            man = json.load(f)
    except ValueError as exc:
        raise CompiledFolderError(f"{path} is not JSON ({exc}): recompile the folder") from None
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise CompiledFolderError(f"{path} records no file hashes: the folder was written by an older "
                                  f"fxmegatron ({man.get('format')}); recompile it with `fxmegatron compile`")
    layout = man.get("layout", {})
    loaded = [f"pp{p}-tp{t}/{name}" for p in range(layout.get("pp", 1)) for t in range(layout.get("tp", 1))
              for name in ("stage.py", "weights.safetensors")]
    for rel in loaded:     # a manifest that forgets a file would let it load unchecked
        if rel not in files:
            raise CompiledFolderError(f"{path} records no hash for {rel}, which load_folder reads; "
                                      "recompile the folder with `fxmegatron compile`")
    for rel in sorted(files):
        parts = rel.split("/")
        if os.path.isabs(rel) or ".." in parts:
            raise CompiledFolderError(f"{path} records {rel}, which is not a path inside the folder")
        if not os.path.isfile(os.path.join(folder, *parts)):
            raise CompiledFolderError(f"{folder}: {rel} is recorded in {MANIFEST} but missing from the "
                                      "folder; recompile it or copy it again whole")
    for d in sorted({os.path.dirname(rel) for rel in files}):
        for name in sorted(os.listdir(os.path.join(folder, d))):
            rel = f"{d}/{name}" if d else name
            if name.endswith(".py") and rel not in files:
                raise CompiledFolderError(f"{folder}: {rel} is not recorded in {MANIFEST}: it was added after the "
                                          f"folder was written, and the stage code could import it; {_TRUST}")
    # the cheap refusals first: hashing reads every byte of every rank's weights
    for rel in sorted(files):
        if file_sha256(os.path.join(folder, *rel.split("/"))) != files[rel]:
            raise CompiledFolderError(f"{folder}: {rel} was modified after the folder was written (its SHA-256 "
                                      f"is not the one {MANIFEST} records); {_TRUST}. Recompile it or copy it "
                                      "again")
    return CheckedFolder(folder, man)


# ---- loading -----------------------------------------------------------------------------
def _load_stage(path: str, name: str, groups: Dict[str, str]) -> types.ModuleType:
    """The generated module, its symbolic group names ("@tp") bound to this job's groups in
    its source: each loaded program carries its own binding, nothing global."""
    with open(path, "rb") as f:
        src = f.read().decode("utf-8")
    for sym, real in groups.items():
        src = src.replace(repr(sym), repr(real))
    mod = types.ModuleType(name)
    mod.__file__ = path
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def load_folder(folder: Union[str, CheckedFolder], mesh, device=None, grad_accum_dtype=None):
    """A ``ParallelModel`` for this rank from a compiled folder (no model code needed): a path,
    which is checked first (``check_folder``), or what ``check_folder`` returned.
    ``grad_accum_dtype``: as ``parallelize``'s."""
    from fxmegatron.mesh import mesh_axes, runtime_device
    from fxmegatron.passes.pipeline_split import Chunk
    from fxmegatron.program import PipelineProgram, RankProgram
    from fxmegatron.runtime.model import ParallelModel
    from fxmegatron.lower.stages import Stage
    from fxmegatron.schedules import make_schedule
    from fxmegatron.schedules.runtime import TensorSpec

    folder, man = folder if isinstance(folder, CheckedFolder) else check_folder(folder)
    axes = mesh_axes(mesh)
    for dim in ("pp", "tp"):
        if axes[dim].size != man["layout"][dim]:
            raise CompiledFolderError(f"{folder} was compiled for {dim}={man['layout'][dim]}, the mesh has "
                                      f"{dim}={axes[dim].size}")
    device = device or runtime_device(mesh)
    pp, tp, dp = axes["pp"], axes["tp"], axes["dp"]
    sub = os.path.join(folder, f"pp{pp.rank}-tp{tp.rank}")
    stage_mod = _load_stage(os.path.join(sub, "stage.py"), f"fxmegatron_stage_pp{pp.rank}_tp{tp.rank}",
                            {"@" + dim: axes[dim].group_name for dim in ("tp", "pp", "dp")})
    with safe_open(os.path.join(sub, "weights.safetensors"), "pt") as f:
        param_names = set(json.loads(f.metadata()["parameters"]))
        tensors = {k: f.get_tensor(k).to(device) for k in f.keys()}
    params = {n: nn.Parameter(tensors[n]) for n in param_names}
    tensors.update(params)
    chunks = [Chunk(c["index"], None, c["boundary_in"], c["boundary_out"], c["batch_inputs"], c["units"],
                    c["cost"], c["params"], c["boundary_grad"]) for c in man["chunks"]]
    modules = {c.index: getattr(stage_mod, f"Chunk{c.index}")(tensors) for c in chunks
               if c.index % pp.size == pp.rank}
    for m in modules.values():
        m.to(device)
        for sub_m in m.modules():     # data-parallel replicas draw their own dropout masks
            if isinstance(sub_m, DropoutRng):
                sub_m.seed = man["seed"] + DP_SEED_STRIDE * dp.rank
    sched = make_schedule(man["schedule"], pp.size, man["virtual_stages"], man["microbatches"])
    specs = {int(k): [TensorSpec(tuple(s["shape"]), getattr(torch, s["dtype"]), s["grad"],
                                 None if s.get("eval_shape") is None else tuple(s["eval_shape"])) for s in v]
             for k, v in man["specs"].items()}
    shared = {n: (tuple(s["shape"]), getattr(torch, s["dtype"])) for n, s in man["shared"].items()}
    placements = {p["name"]: placement_from_json(p["placement"]) for p in man["params"]}
    count = _token_count(stage_mod, man, device, dp.size, folder)
    program = RankProgram(
        axes=axes, device=torch.device(device), in_spec=pytree.treespec_loads(man["in_spec"]),
        input_names=tuple(man.get("input_names") or [f"input {i}" for i in range(len(man["batch"]))]),
        example_inputs=tuple(torch.empty(b["shape"], dtype=getattr(torch, b["dtype"]), device="meta")
                             for b in man["batch"]),
        param_order=tuple(p["name"] for p in man["params"]),
        global_params={p["name"]: (tuple(p["shape"]), getattr(torch, p["dtype"])) for p in man["params"]},
        aliases=man["aliases"], placements=placements, sequence_parallel=man["sequence_parallel"],
        recompute=man["recompute"], seed=man["seed"], microbatches=man["microbatches"],
        pipeline=PipelineProgram(sched, tuple(chunks), Stage(modules, params, shared), specs),
        count_tokens=count if man["microbatches"] > 1 or dp.size > 1 else None, token_count=count)
    return ParallelModel(program, grad_accum_dtype)


def _token_count(stage_mod, man, device, dp: int, folder: str):
    """The folder's token counter (``CountTokens``), or None; a folder without one is refused
    where the batch is split (microbatches or replicas would be weighted 1/m, not by their
    counted labels: wrong when they count different numbers)."""
    from fxmegatron.lower.stages import counter_of
    if hasattr(stage_mod, "CountTokens") and man.get("count_ignore") is not None:
        return counter_of(stage_mod.CountTokens({}).to(device), man["count_ignore"])
    if man["microbatches"] > 1 or dp > 1:
        raise CompiledFolderError(
            f"{folder} holds no token counter (written before fxmegatron wrote one, or for a loss whose "
            f"counted labels are not a function of the batch alone), so its {man['microbatches']} "
            f"microbatch(es) x {dp} replica(s) cannot be weighted by the labels each counts: compile it "
            "again with this version, or launch it with microbatches=1 and dp=1")
    return None
