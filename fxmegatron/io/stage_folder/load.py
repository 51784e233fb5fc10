"""Loading a compiled folder: ``load_folder`` checks it (``check.check_folder``), executes
each rank's ``stage.py`` with its symbolic group names bound to this job's groups, reads the
weights (safetensors: no pickles) and builds a ``ParallelModel``. ``attach`` is what the
generated classes call to set their weights and submodules.
"""
from __future__ import annotations

import json
import os
import types
from typing import Dict, Union

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from safetensors import safe_open

from fxmegatron.lower.rank_passes import DP_SEED_STRIDE
from fxmegatron.errors import CompiledFolderError
from fxmegatron.io.stage_folder.check import CheckedFolder, check_folder
from fxmegatron.ops.dropout import DropoutRng
from fxmegatron.placement import layout_from_json, placement_from_json


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
    # per axis ("layout"); folders written before it hold tp's placement alone ("placement")
    placements = {p["name"]: layout_from_json(p["layout"]).on("tp") if "layout" in p
                  else placement_from_json(p["placement"]) for p in man["params"]}
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
