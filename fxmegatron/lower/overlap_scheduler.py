"""How inductor's overlap scheduler is asked to place ``dp_shard="full"``'s collectives.

The scheduler (``torch._inductor.fx_passes.overlap_scheduling``, the pass torchtitan's
SimpleFSDP uses) reorders a post-grad graph so that each functional collective starts early
enough for compute to hide it and is waited for late, within a memory budget. By default it
pins that order by wrapping the nodes it moved in ``control_deps`` subgraphs
(``aten_distributed_optimizations.insert_overlap_deps``, None meaning True). Those
subgraphs cannot hold an ``auto_functionalized`` op (torch 2.11: "auto_functionalized_v2 is
not an OpOverload", pytorch#182947), which the loss's in-place backward is
(``passes.loss_grad_in_place``): where they are inserted, the loss's backward is stated as
torch ops instead (``loss_grad_in_graph``), which inductor may write over the logits itself
(``rank_passes``).

The default is kept because it measured faster: on two H200 (Llama-3-8B shape, 32 layers)
the wrappers kept exposed communication at 1% of the step (1.05× FSDP2), while without them
(the user's ``insert_overlap_deps = False``, which fxmegatron respects) inductor's own
scheduling undid part of the overlap (9%, 1.01× FSDP2) but the loss's gradient went back over
the logits (2.4 GiB less peak memory). docs/TRAINING.md has the figures.
"""
from __future__ import annotations

OVERLAP_SCHEDULING = "aten_distributed_optimizations.enable_overlap_scheduling"
OVERLAP_DEPS = "aten_distributed_optimizations.insert_overlap_deps"


def _dist_options():
    import torch._inductor.config as config
    return getattr(config, "aten_distributed_optimizations", None)


def has_scheduler() -> bool:
    # hasattr, not dir(): inductor's config module answers its keys through __getattr__
    return hasattr(_dist_options(), "enable_overlap_scheduling")


def scheduler_wraps_nodes() -> bool:
    """Whether the scheduler, asked for, wraps the nodes it moved in ``control_deps``: unless
    the user set ``insert_overlap_deps`` False (a torch without that option always wraps)."""
    opts = _dist_options()
    return not hasattr(opts, "insert_overlap_deps") or opts.insert_overlap_deps is not False


def scheduling_options() -> dict:
    """Inductor options that turn the scheduler on for one compile ({} where this torch has none)."""
    return {OVERLAP_SCHEDULING: True} if has_scheduler() else {}
