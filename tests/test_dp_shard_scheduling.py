"""Who schedules ``dp_shard="full"``'s collectives: compiled on GPUs, the gathers are torch's
functional collectives and inductor's overlap scheduler places them (``lower.torch_compile``);
everywhere else the graph's order stands. The run-time half (the compiled graph's gathers are
functional collectives, counted as they run, and train exactly) is in
``tests/test_fully_sharded_dp.py``."""
import pytest

import torch

from fxmegatron.layout import Layout
from fxmegatron.lower.rank_passes import rank_passes, schedules_collectives, tp_passes
from fxmegatron.lower.overlap_scheduler import OVERLAP_DEPS, OVERLAP_SCHEDULING, scheduler_wraps_nodes
from fxmegatron.lower.torch_compile import inductor_options
from fxmegatron.mesh import Axis

DIST = getattr(torch._inductor.config, "aten_distributed_optimizations", None)
HAS_SCHEDULER = hasattr(DIST, "enable_overlap_scheduling")
HAS_DEPS_SETTING = hasattr(DIST, "insert_overlap_deps")


def _axes(dp=2, cp=1):
    return {"dp": Axis(size=dp), "cp": Axis(size=cp), "tp": Axis(), "pp": Axis()}


@pytest.mark.parametrize("mode, compile, device, axes, expected", [
    ("full", True, "cuda", _axes(), True),
    ("full", "max-autotune-no-cudagraphs", "cuda:1", _axes(), True),
    ("full", True, "cuda", _axes(dp=1, cp=2), True),        # the shards are over dp × cp
    ("full", True, "cpu", _axes(), False),                  # inductor's scheduler estimates GPU times
    ("full", True, None, _axes(), False),                   # planning: no device
    ("full", False, "cuda", _axes(), False),                # eager: nothing to schedule
    ("full", True, "cuda", _axes(dp=1), False),             # a group of one: no collectives
    ("optimizer", True, "cuda", _axes(), False),            # the runtime's buckets, not graph nodes
    ("none", True, "cuda", _axes(), False),
])
def test_only_full_sharding_compiled_on_gpus_is_scheduled(mode, compile, device, axes, expected):
    cfg = Layout(dp=axes["dp"].size, cp=axes["cp"].size, dp_shard=mode, compile=compile)
    assert schedules_collectives(cfg, axes, device) is expected


def test_the_scheduler_is_asked_for_only_where_scheduled():
    assert OVERLAP_SCHEDULING not in inductor_options()
    assert OVERLAP_SCHEDULING not in inductor_options("max-autotune-no-cudagraphs")
    opts = inductor_options("max-autotune-no-cudagraphs", schedule_collectives=True)
    assert opts.get(OVERLAP_SCHEDULING) is (True if HAS_SCHEDULER else None)
    assert opts["max_autotune"] is True                     # the mode's own options kept
    assert "post_grad_custom_post_pass" in opts


@pytest.mark.skipif(not HAS_DEPS_SETTING, reason="this torch's overlap scheduler always inserts control_deps")
def test_the_users_choice_of_control_deps_is_left_to_inductor():
    """fxmegatron asks for the scheduler and leaves insert_overlap_deps as the user set it:
    None (inductor's default, wrapped), True or False."""
    for chosen, wraps in ((None, True), (True, True), (False, False)):
        with torch._inductor.config.patch({OVERLAP_DEPS: chosen}):
            assert OVERLAP_DEPS not in inductor_options(schedule_collectives=True)
            assert scheduler_wraps_nodes() is wraps


def test_the_loss_grad_writes_over_the_logits_unless_control_deps_wrap_it():
    """Where the scheduler wraps the nodes it orders in control_deps, which cannot hold the
    in-place loss backward's auto_functionalized op, the pass that makes it in place is left
    out and the loss's backward is stated as torch ops instead (inductor's in-place call);
    elsewhere (not scheduled, or scheduled without the wrappers) the kernel's pass stays."""
    names = lambda **kw: [p.name for p in tp_passes(None, 1, 0, "", False, 0, **kw)]
    assert "loss_grad_reuses_logits" in names()
    assert "loss_grad_reuses_logits" not in names(loss_grad="graph")
    assert "loss_grad_in_graph" in names(loss_grad="graph")
    assert not {"loss_grad_reuses_logits", "loss_grad_in_graph"} & set(names(loss_grad="none"))
    cfg = Layout(dp=2, dp_shard="full", compile=True)
    in_rank = lambda device: [p.name for p in rank_passes(None, _axes(), cfg, device)]    # noqa: E731
    assert "loss_grad_reuses_logits" in in_rank("cpu")          # not scheduled
    assert "loss_grad_in_graph" in in_rank("cuda")               # scheduled, wrapped (inductor's default)
    assert "loss_grad_reuses_logits" not in in_rank("cuda")
    if HAS_DEPS_SETTING:
        with torch._inductor.config.patch({OVERLAP_DEPS: False}):
            assert "loss_grad_reuses_logits" in in_rank("cuda")
