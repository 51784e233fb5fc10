"""How inductor's overlap scheduler is asked to place ``dp_shard="full"``'s collectives.

The scheduler (``torch._inductor.fx_passes.overlap_scheduling``, the pass torchtitan's
SimpleFSDP uses) reorders a post-grad graph so that each functional collective starts early
enough for compute to hide it and is waited for late, within a memory budget. It can then
pin its order by wrapping the nodes it moved in ``control_deps`` subgraphs. Those subgraphs
cannot hold an ``auto_functionalized`` op (torch 2.11: "auto_functionalized_v2 is not an
OpOverload", pytorch#182947), which the loss's in-place backward is
(``passes.loss_grad_in_place``), and inductor does not fuse across them. Left unwrapped, the
order stands as the graph's: inductor's scheduler keeps the order of the nodes it does not
fuse.

Three ways, by what the installed torch offers:

- ``"config"``: inductor has ``aten_distributed_optimizations.insert_overlap_deps``; the
  scheduler is switched on by option, unwrapped unless the user set that option True;
- ``"direct"``: no such option, but ``schedule_overlap_bucketing`` takes
  ``insert_overlap_deps``: fxmegatron's post-grad pass calls it, unwrapped;
- ``"wrapped"``: only the wrapping scheduler (then the loss's backward makes a new gradient).
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

OVERLAP_SCHEDULING = "aten_distributed_optimizations.enable_overlap_scheduling"
OVERLAP_DEPS = "aten_distributed_optimizations.insert_overlap_deps"


def _dist_options():
    import torch._inductor.config as config
    return getattr(config, "aten_distributed_optimizations", None)


def _unwrapped_call():
    """``schedule_overlap_bucketing`` where it takes ``insert_overlap_deps``, else None."""
    try:
        from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing
    except ImportError:
        return None
    try:
        params = inspect.signature(schedule_overlap_bucketing).parameters
    except (TypeError, ValueError):
        return None
    return schedule_overlap_bucketing if "insert_overlap_deps" in params else None


def scheduler_way() -> Optional[str]:
    """"config", "direct", "wrapped" (see the module doc), or None: no scheduler in this torch."""
    opts = _dist_options()
    if not hasattr(opts, "enable_overlap_scheduling"):
        return None
    if hasattr(opts, "insert_overlap_deps"):
        return "config"
    return "direct" if _unwrapped_call() is not None else "wrapped"


def scheduler_wraps_nodes() -> bool:
    """Whether the scheduler, asked for, wraps the nodes it moved in ``control_deps``."""
    way = scheduler_way()
    return way == "wrapped" or way == "config" and _dist_options().insert_overlap_deps is True


def scheduling_options(base_pass) -> dict:
    """Inductor options that turn the scheduler on for one compile, ``base_pass`` being the
    post-grad custom pass fxmegatron already runs (the direct way runs the scheduler after it,
    as inductor's own would)."""
    way = scheduler_way()
    if way is None:
        return {}
    if way == "direct":
        return {"post_grad_custom_post_pass": _then_schedule(base_pass)}
    options = {OVERLAP_SCHEDULING: True}
    if way == "config" and _dist_options().insert_overlap_deps is None:
        options[OVERLAP_DEPS] = False
    return options


@functools.lru_cache(maxsize=None)
def _then_schedule(base_pass):
    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass
    wait = torch.ops._c10d_functional.wait_tensor.default

    class ThenScheduleCollectives(CustomGraphPass):
        def __call__(self, graph) -> None:
            base_pass(graph)
            if any(n.op == "call_function" and n.target is wait for n in graph.nodes):
                _unwrapped_call()(graph.owning_module, insert_overlap_deps=False)

        def uuid(self):
            return f"{base_pass.uuid()}+overlap_scheduling"

    return ThenScheduleCollectives()
