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
def test_the_scheduler_leaves_its_order_unwrapped_unless_the_user_chose():
    assert inductor_options(schedule_collectives=True)[OVERLAP_DEPS] is False
    assert OVERLAP_DEPS not in inductor_options()
    assert not scheduler_wraps_nodes()
    for chosen in (True, False):        # an explicit inductor setting is the user's
        with torch._inductor.config.patch({OVERLAP_DEPS: chosen}):
            assert OVERLAP_DEPS not in inductor_options(schedule_collectives=True)
            assert scheduler_wraps_nodes() is chosen


def test_the_loss_grad_writes_over_the_logits_unless_control_deps_wrap_it():
    """Where the scheduler wraps the nodes it orders in control_deps, which cannot hold the
    in-place loss backward's auto_functionalized op, the pass that makes it in place is left
    out; elsewhere (not scheduled, or scheduled without the wrappers) it stays."""
    names = lambda **kw: [p.name for p in tp_passes(None, 1, 0, "", False, 0, **kw)]
    assert "loss_grad_reuses_logits" in names()
    assert "loss_grad_reuses_logits" not in names(loss_grad_in_place=False)
    cfg = Layout(dp=2, dp_shard="full", compile=True)
    in_rank = lambda device: "loss_grad_reuses_logits" in [p.name for p in rank_passes(None, _axes(), cfg, device)]
    assert in_rank("cpu")                                   # not scheduled
    assert in_rank("cuda") is not scheduler_wraps_nodes()
    if HAS_DEPS_SETTING:
        assert in_rank("cuda")
        with torch._inductor.config.patch({OVERLAP_DEPS: True}):
            assert not in_rank("cuda")


class _Options:       # inductor's aten_distributed_optimizations as an older torch has it
    enable_overlap_scheduling = False


def _older_torch(monkeypatch, takes_deps: bool):
    import fxmegatron.lower.overlap_scheduler as sched
    calls = []

    def schedule_overlap_bucketing(gm, insert_overlap_deps=True):
        calls.append(insert_overlap_deps)
    monkeypatch.setattr(sched, "_dist_options", lambda: _Options())
    monkeypatch.setattr(sched, "_unwrapped_call", lambda: schedule_overlap_bucketing if takes_deps else None)
    return calls


def test_without_the_option_fxmegatron_runs_the_scheduler_unwrapped_after_its_own_pass(monkeypatch):
    """torch 2.11: no insert_overlap_deps option, but the scheduler function takes it. The
    post-grad pass runs the loss's copy-back, then the scheduler, unwrapped, where the graph
    waits for a collective; the loss's gradient stays in place."""
    import torch.fx as fx
    calls = _older_torch(monkeypatch, takes_deps=True)
    opts = inductor_options(schedule_collectives=True)
    assert OVERLAP_SCHEDULING not in opts and not scheduler_wraps_nodes()
    run = opts["post_grad_custom_post_pass"]
    assert run.uuid() != inductor_options()["post_grad_custom_post_pass"].uuid()   # another cache key
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.neg.default, (x,)))
    run(g)
    assert calls == []                                      # nothing to wait for: not scheduled
    g.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,))
    run(g)
    assert calls == [False]
    cfg = Layout(dp=2, dp_shard="full", compile=True)
    assert "loss_grad_reuses_logits" in [p.name for p in rank_passes(None, _axes(), cfg, "cuda")]


def test_where_only_the_wrapping_scheduler_exists_the_loss_grad_is_a_new_tensor(monkeypatch):
    calls = _older_torch(monkeypatch, takes_deps=False)
    opts = inductor_options(schedule_collectives=True)
    assert opts[OVERLAP_SCHEDULING] is True and OVERLAP_DEPS not in opts and scheduler_wraps_nodes()
    cfg = Layout(dp=2, dp_shard="full", compile=True)
    assert "loss_grad_reuses_logits" not in [p.name for p in rank_passes(None, _axes(), cfg, "cuda")]
    assert "loss_grad_reuses_logits" in [p.name for p in rank_passes(None, _axes(), cfg, "cpu")]
    assert calls == []
