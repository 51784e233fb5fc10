"""The compiler's rank-level steps between capture and the runtime: the graph passes that make
one tensor-parallel rank's graph, and its materialisation with local shards."""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxmegatron.capture import Captured, retarget_device
from fxmegatron.errors import ShardingError
from fxmegatron.passes.dropout_rng import apply_counter_rng
from fxmegatron.passes.tensor_parallel import TPPlan, apply_tensor_parallel, plan_tensor_parallel
from fxmegatron.passes.trivial_collectives import drop_trivial_collectives
from fxmegatron.placement import R
from fxmegatron.runtime.materialize import local_parameter
from fxmegatron.runtime.stages import split_batch
from fxmegatron.schedules import ScheduleError

def transform_rank(gm: fx.GraphModule, cap: Captured, tp: int, tp_rank: int, group_name: str,
                   sequence_parallel: bool, seed: int, dp_rank: int = 0) -> TPPlan:
    """The graph passes that make one tensor-parallel rank's graph from the captured one, in
    place: placement planning, the rewrite with f/g and sequence collectives on
    ``group_name``, and counter-based dropout. Returns the plan."""
    plan = plan_tensor_parallel(gm, tp, cap.params.keys(), sequence_parallel)
    apply_tensor_parallel(gm, plan, tp_rank, group_name)
    if tp == 1:
        drop_trivial_collectives(gm)
    # data-parallel replicas see different samples: their dropout masks must differ too
    apply_counter_rng(gm, tp_rank, tp, seed + 0x9E3779B1 * dp_rank)
    return plan


def first_microbatch(batch, m: int, dp: int = 1):
    """The graph is traced at microbatch size (shapes are static): the example batch (the
    global batch of a step) split over dp ranks, then into m microbatches; the first piece."""
    if m < 1:
        raise ScheduleError(f"microbatches={m}: must be >= 1")
    if m * dp == 1:
        return batch
    flat, spec = pytree.tree_flatten(batch)
    names = [f"example batch input {i}" for i in range(len(flat))]
    if dp > 1:
        flat = split_batch(flat, dp, names, f"dp={dp}")[0]
    return pytree.tree_unflatten(split_batch(flat, m, names)[0], spec)


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
        else:   # lifted constants and submodules (the dropout RNG)
            t = getattr(gm, node.target)
            root[node.target] = t.to(device) if isinstance(t, torch.Tensor) else t
    local = fx.GraphModule(root, gm.graph)
    return retarget_device(local, device)


def check_local_shapes(gm: fx.GraphModule, cap: Captured) -> None:
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
