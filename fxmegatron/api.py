"""``parallelize`` and the object it returns."""
from __future__ import annotations

import time
from typing import Dict, Iterator, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .capture import Captured, batch_args, capture, retarget_device
from .dump import write_dump
from .errors import MeshError, ShardingError
from .materialize import local_parameter
from .passes.dropout_rng import RNG_ATTR, apply_counter_rng
from .passes.recompute import apply_recompute
from .passes.tensor_parallel import TPPlan, apply_tensor_parallel, plan_tensor_parallel
from .placement import Placement, R, join_shards

_SUPPORTED_DIMS = ("tp",)


def _tp_group(mesh) -> Tuple[int, int, str]:
    """(tp size, tp rank, group name) from a DeviceMesh, after checking it."""
    if mesh is None:
        return 1, 0, ""
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" not in names:
        raise MeshError(f"the device mesh has dims {names or '(unnamed)'}; fxmegatron needs one named 'tp' "
                        "(e.g. init_device_mesh('cuda', (2,), mesh_dim_names=('tp',)))")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        raise MeshError(f"the device mesh {dict(zip(names, mesh.shape))} has {mesh.size()} devices but the "
                        f"world size is {world}: the mesh must cover every process")
    for n, s in zip(names, mesh.shape):
        if n not in _SUPPORTED_DIMS and s > 1:
            raise MeshError(f"mesh dim {n!r} of size {s} is not supported yet (supported: {_SUPPORTED_DIMS})")
    tp_mesh = mesh["tp"] if len(names) > 1 else mesh
    return tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group().group_name


def _runtime_device(mesh) -> torch.device:
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    if mesh.device_type == "meta":
        return torch.device("meta")
    return torch.device(mesh.device_type, torch.cuda.current_device())


class ParallelModel(nn.Module):
    """One rank's piece of the parallel program.

    Call it with a batch shaped like the example batch to get the loss;
    ``parameters()`` are this rank's local shards (tied weights appear once).
    """

    def __init__(self, gm: fx.GraphModule, captured: Captured, plan: TPPlan, tp: Tuple[int, int, str],
                 timings: Dict[str, float]):
        super().__init__()
        self.graph_module = gm
        self._in_spec = captured.in_spec
        self._aliases = captured.aliases
        self._plan = plan
        self.tp_size, self.tp_rank, self._group_name = tp
        self.timings = timings
        self._recompute = "none"

    # parameters keep the original model's names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        return self.graph_module.named_parameters(prefix, recurse, remove_duplicate)

    def placement(self, name: str) -> Placement:
        """How parameter ``name`` (original model's name) is split over tp."""
        return self._plan.param_plc.get(self._aliases.get(name, name), R)

    def forward(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list, dict)):
            args, kwargs = batch_args(args[0])
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise TypeError(f"batch structure {spec} differs from the example batch's {self._in_spec}")
        return self.graph_module(*flat)[0]

    # ---- gathering shards ------------------------------------------------------
    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        plc = self.placement(name)
        if self.tp_size == 1 or plc == R:
            return local.detach().clone()
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(self._group_name)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.detach().contiguous(), group=pg)
        return join_shards(parts, plc)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Whole parameters (collective over tp: every rank must call it), under
        every name the unmodified model uses, tied names included."""
        out = {n: self._gather(n, p) for n, p in self.named_parameters()}
        for alias, canon in self._aliases.items():
            out[alias] = out[canon]
        return out

    def full_grads(self) -> Dict[str, torch.Tensor]:
        """Whole gradients of every parameter (collective over tp)."""
        return {n: self._gather(n, p.grad) for n, p in self.named_parameters() if p.grad is not None}

    def dump(self, directory: str) -> None:
        """Write this rank's transformed graph, placements, collectives and decisions."""
        info = {"tp": f"{self.tp_size} (rank {self.tp_rank})",
                "sequence parallel": str(self._plan.sequence_parallel),
                "recompute": str(self._recompute),
                "planning attempts": str(self._plan.attempts)}
        for name, why in self._plan.replicated_params.items():
            info[f"kept replicated: {name}"] = why
        write_dump(f"{directory}/rank{dist.get_rank() if dist.is_initialized() else 0}", self.graph_module, info)


def parallelize(model: nn.Module, mesh, example_batch, *, sequence_parallel: bool = False,
                recompute="none", state_dict: Optional[Mapping] = None, seed: int = 0, verbose: bool = False) -> ParallelModel:
    """Trace ``model`` on ``example_batch`` and return this rank's tensor-parallel piece.

    ``mesh``: a torch DeviceMesh with a "tp" dim (or None: one process, no split).
    ``example_batch``: what ``model`` is called with (tuple -> positional, dict ->
    keyword); its forward must return the loss. ``sequence_parallel``: norms, dropout
    and residual adds run on sequence shards between tensor-parallel regions (g becomes
    a reduce-scatter, f an all-gather). ``recompute``: "none", "selective" (attention
    core), "full" (each transformer block) or a ``RecomputePolicy``. Weights come from ``state_dict``,
    else from the model, else (meta model) are initialised shard by shard.
    """
    tp = _tp_group(mesh)
    device = _runtime_device(mesh)
    timings = {}
    t0 = time.perf_counter()
    cap = capture(model, example_batch)
    timings["capture_s"] = time.perf_counter() - t0
    gm = cap.gm
    t0 = time.perf_counter()
    plan = plan_tensor_parallel(gm, tp[0], cap.params.keys(), sequence_parallel)
    apply_tensor_parallel(gm, plan, tp[1], tp[2])
    apply_counter_rng(gm, tp[1], tp[0], seed)
    timings["tensor_parallel_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    local = assemble_local(gm, cap, plan, tp[1], tp[0], device, state_dict, seed)
    timings["materialize_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _check_local_shapes(local, cap)
    if hasattr(local, RNG_ATTR):
        getattr(local, RNG_ATTR).step = 0   # the shape check ran one forward
    timings["shape_check_s"] = time.perf_counter() - t0
    apply_recompute(local, recompute)
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print("fxmegatron: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()), flush=True)
    pm = ParallelModel(local, cap, plan, tp, timings)
    pm._recompute = recompute if isinstance(recompute, str) else getattr(recompute, "name", str(recompute))
    return pm


def assemble_local(gm: fx.GraphModule, cap: Captured, plan: TPPlan, rank: int, world: int, device,
                   state_dict: Optional[Mapping] = None, seed: int = 0) -> fx.GraphModule:
    """The rank's GraphModule: its parameter shards, buffers and submodules, on ``device``."""
    root = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        if node.target in cap.params:
            root[node.target] = local_parameter(node.target, cap.params[node.target],
                                                plan.param_plc.get(node.target, R), rank, world,
                                                device, state_dict, seed)
        elif node.target in cap.buffers:
            root[node.target] = cap.buffers[node.target].to(device)
        else:
            root[node.target] = getattr(gm, node.target)
    local = fx.GraphModule(root, gm.graph)
    return retarget_device(local, device)


def _check_local_shapes(gm: fx.GraphModule, cap: Captured) -> None:
    """Propagate fake tensors with the local shards: shapes of the rewritten graph
    must be consistent, and each node ends up with its local value in meta["val"]."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            inputs.append(mode.from_tensor(v) if isinstance(v, torch.Tensor) else v)
    dev = next((p.device for p in gm.parameters()), torch.device("cpu"))
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs]
    try:
        with mode:
            FakeTensorProp(gm, mode).propagate(*inputs)
    except Exception as exc:
        raise ShardingError(f"the tensor-parallel graph is inconsistent: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
