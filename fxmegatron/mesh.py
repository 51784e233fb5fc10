"""The device mesh as one rank sees it: an ``Axis`` per dim ("dp", "pp", "cp", "tp") and the
device the rank runs on. With context parallelism and data parallelism both, gradients are
reduced over the two together ("dp_cp", a flattened mesh dim). Under hybrid sharding
(``dp_replicate`` > 1) "dp_cp" is one replica group's ranks, the ones that shard, and
"dp_replicate" the ranks holding the same shard in the other groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fxmegatron.errors import MeshError

KNOWN_DIMS = ("dp", "pp", "cp", "tp")
SUPPORTED_DIMS = ("dp", "pp", "cp", "tp")
ALL_AXES = ("dp", "tp", "pp", "cp", "dp_cp", "dp_replicate", "ep", "edp")
MESH_ATTRS = ("mesh_dim_names", "shape", "size", "device_type")


@dataclass(frozen=True)
class Axis:
    """One mesh dimension as this rank sees it."""

    size: int = 1
    rank: int = 0
    group_name: str = ""
    ranks: Tuple[int, ...] = (0,)     # global ranks of the group, in group order

    @property
    def group(self):
        if not self.group_name:
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(self.group_name)


def mesh_axes(mesh, dp_replicate: int = 1, ep: int = 1) -> Dict[str, Axis]:
    """{"dp": Axis, "pp": Axis, "cp": Axis, "tp": Axis, "dp_cp": Axis, "dp_replicate": Axis} from a
    DeviceMesh, after checking it ("dp_cp": the ranks that hold the same parameters and sum their
    gradients, or under ``dp_replicate`` > 1 the ranks of one replica group, which shard them;
    "dp_replicate": the ranks that hold the same shard). ``ep`` > 1: expert parallelism folded onto
    dp, "ep" the ep consecutive dp ranks (at one cp rank) that share their experts, "edp" the ranks
    that hold the same experts, dp / ep of them times cp (their gradients summed over them); under
    ``dp_replicate`` > 1 those of one replica group, dp / dp_replicate / ep times cp, the holders of
    the same experts in the other groups being "dp_replicate" (as the dense weights' pieces)."""
    if mesh is None:
        return {n: Axis() for n in ALL_AXES}
    # the tests' stand-ins (and any object with DeviceMesh's interface) pass; a device name,
    # a shape or a process group is refused here rather than as an AttributeError below
    if not isinstance(mesh, DeviceMesh) and not all(hasattr(mesh, a) for a in MESH_ATTRS):
        raise MeshError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (or None: one process), got "
                        f"{type(mesh).__name__} {mesh!r}: build one with init_device_mesh('cpu' or 'cuda', "
                        "(2, 2), mesh_dim_names=('pp', 'tp')) after init_process_group")
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in KNOWN_DIMS]
    if not names or unknown:
        raise MeshError(f"the device mesh has dims {names or '(unnamed)'}; fxmegatron needs dims named from "
                        f"{KNOWN_DIMS}, e.g. 'tp' (init_device_mesh('cuda', (2,), mesh_dim_names=('tp',))) "
                        "or ('pp', 'tp')")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.size() != world:
        raise MeshError(f"the device mesh {dict(zip(names, mesh.shape))} has {mesh.size()} devices but the "
                        f"world size is {world}: the mesh must cover every process")
    for n, s in zip(names, mesh.shape):
        if n not in SUPPORTED_DIMS and s > 1:
            raise MeshError(f"mesh dim {n!r} of size {s} is not supported yet (supported: {SUPPORTED_DIMS})")
    axes = {}
    for n in ("dp", "tp", "pp", "cp"):
        axes[n] = _axis(mesh[n] if len(names) > 1 else mesh) if n in names else Axis()
    axes["dp_replicate"] = Axis()
    axes["ep"], axes["edp"] = Axis(), axes["dp"]
    if ep > 1:
        _experts(mesh, names, axes, ep, dp_replicate)
    if dp_replicate > 1:
        return _hybrid(mesh, names, axes, dp_replicate)
    both = [n for n in ("dp", "cp") if axes[n].size > 1]
    if len(both) == 2:
        axes["dp_cp"] = _axis(mesh["dp", "cp"]._flatten("dp_cp"))
    else:
        axes["dp_cp"] = axes[both[0]] if both else Axis()
    return axes


def _hybrid(mesh, names, axes: Dict[str, Axis], replicate: int) -> Dict[str, Axis]:
    # the dp dim cut in (replicate, shard): a DeviceMesh over the same ranks with those two dims
    # (built by every rank, as DeviceMesh's groups must be), then the shard dim flattened with cp
    dp = axes["dp"].size
    if dp % replicate:
        raise MeshError(f"dp_replicate={replicate}: the mesh's dp dim of {dp} does not split into {replicate} groups")
    shard = dp // replicate
    if shard * axes["cp"].size == 1:
        raise MeshError(f"dp_replicate={replicate} = dp leaves each group one rank to shard over: that is plain "
                        "data parallelism (dp_shard='none', dp_replicate=1)")
    split = _split_mesh(mesh, names, (replicate, shard))
    axes["dp_replicate"] = _axis(split["dp_replicate"])
    if axes["cp"].size > 1:
        axes["dp_cp"] = _axis(split["dp_shard", "cp"]._flatten("dp_shard_cp"))
    else:
        axes["dp_cp"] = _axis(split["dp_shard"])
    return axes


def _experts(mesh, names, axes: Dict[str, Axis], ep: int, replicate: int = 1) -> None:
    # the dp dim cut in (dp_replicate, edp, ep): ep consecutive dp ranks share their experts, and an
    # ep group lies inside one replica group, so that the experts, like the dense weights, are
    # sharded within a group and their pieces summed over "dp_replicate" (whose ranks hold the same
    # experts: the same place in another group)
    dp = axes["dp"].size
    if dp % ep:
        raise MeshError(f"ep={ep}: expert parallelism folds onto the data-parallel ranks, and the mesh's dp dim "
                        f"of {dp} does not split into groups of {ep}")
    if replicate > 1 and (dp % replicate or dp // replicate % ep):
        raise MeshError(f"ep={ep}, dp_replicate={replicate}: an ep group must lie inside one replica group, and "
                        f"ep does not divide the {dp} dp ranks / {replicate} groups")
    group = dp // replicate
    # (a dim of one replica group would make DeviceMesh create a group per rank for nothing)
    sizes, dims = ((replicate,), ("dp_replicate",)) if replicate > 1 else ((), ())
    split = _split_mesh(mesh, names, sizes + (group // ep, ep), dims + ("edp", "ep"))
    axes["ep"] = _axis(split["ep"])
    # every cp rank holds the same experts (an ep group sits at one cp rank; routing is per token),
    # each their gradient over its part of the sequence: summed over the dp / ep ranks × cp (of
    # one replica group)
    cp = axes["cp"].size > 1
    axes["edp"] = _axis(split["edp", "cp"]._flatten("edp_cp") if cp else split["edp"])


def _split_mesh(mesh, names, sizes: Tuple[int, ...], dims=("dp_replicate", "dp_shard")) -> DeviceMesh:
    # kept on the user's mesh: every parallelize of it would otherwise create new process groups
    # (NCCL communicators, never freed), and the mesh's lifetime is theirs
    cache = getattr(mesh, "__dict__", {}).setdefault("_fxmegatron_hybrid", {})
    key = (sizes, dims)
    if key not in cache:
        at = names.index("dp")
        grid = mesh.mesh.reshape(*mesh.mesh.shape[:at], *sizes, *mesh.mesh.shape[at + 1:])
        cache[key] = DeviceMesh(mesh.device_type, grid, mesh_dim_names=names[:at] + dims + names[at + 1:])
    return cache[key]


def _axis(sub) -> Axis:
    group = sub.get_group()
    return Axis(sub.size(), sub.get_local_rank(), group.group_name, tuple(dist.get_process_group_ranks(group)))


def runtime_device(mesh, model: Optional[nn.Module] = None) -> torch.device:
    if mesh is None:    # one process: where the model is (a meta model runs on the CPU)
        dev = next((p.device for p in model.parameters()), None) if model is not None else None
        return dev if dev is not None and dev.type != "meta" else torch.device("cpu")
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    if mesh.device_type == "meta":
        return torch.device("meta")
    return torch.device(mesh.device_type, torch.cuda.current_device())
