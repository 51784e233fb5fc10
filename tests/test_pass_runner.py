"""The pass runner (fxmegatron.passes.runner): order checks, and a planted broken pass named."""
import pytest
import torch
import torch.fx as fx

import fxmegatron
from fxmegatron.lower.rank_passes import rank_passes
from fxmegatron.config import ParallelConfig
from fxmegatron.errors import PassError, ShardingError
from fxmegatron.mesh import Axis
from fxmegatron.passes.runner import Pass, PassRunner
from fxmegatron.capture import capture

from tests import models

aten = torch.ops.aten


def _captured():
    name = "gpt"
    return capture(models.build(name, n_layer=2), models.batch(name, batch_size=2))


def _widen_first_view(gm: fx.GraphModule) -> None:
    """A broken pass: the first reshape of the hidden states asks for twice the rows, as a
    rewrite that forgot a tp factor would."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (aten.view.default, aten.reshape.default):
            shape = list(n.args[1])
            shape[0] = shape[0] * 2 if isinstance(shape[0], int) else shape[0]
            n.args = (n.args[0], shape)
            return
    raise AssertionError("no view in the graph")


def test_the_compiler_passes_run_clean_with_the_shape_check_after_each():
    cap = _captured()
    axes = {"dp": Axis(), "pp": Axis(), "tp": Axis()}
    runner = PassRunner(rank_passes(cap, axes, ParallelConfig(recompute="selective")), debug=True)
    gm = runner(cap.gm)
    assert list(runner.timings) == ["slice_writes_to_cat", "tensor_parallel", "loss_reads_logits_dtype", "loss_grad_reuses_logits",
                                    "attention_rewrites", "drop_trivial_collectives", "counter_rng", "localize",
                                    "check_local_shapes", "recompute"]
    assert all(p.device.type == "meta" for p in gm.parameters())


def test_a_planted_broken_pass_is_named_with_the_passes_before_it():
    cap = _captured()
    axes = {"dp": Axis(), "pp": Axis(), "tp": Axis()}
    passes = rank_passes(cap, axes, ParallelConfig())
    at = [p.name for p in passes].index("localize") + 1
    passes.insert(at, Pass("widen_view", _widen_first_view))
    with pytest.raises(PassError, match=r"pass 'widen_view' left the graph's shapes inconsistent \(after "
                                        r"slice_writes_to_cat, tensor_parallel, loss_reads_logits_dtype, loss_grad_reuses_logits, "
                                        r"attention_rewrites, drop_trivial_collectives, counter_rng, localize\)"):
        PassRunner(passes, debug=True)(cap.gm)


def test_without_debug_the_broken_pass_surfaces_later_unnamed():
    """What the debug check buys: without it the same broken pass is caught only by the
    compiler's own shape check, which cannot say which pass broke the graph."""
    cap = _captured()
    axes = {"dp": Axis(), "pp": Axis(), "tp": Axis()}
    passes = rank_passes(cap, axes, ParallelConfig())
    passes.insert(0, Pass("widen_view", _widen_first_view))
    with pytest.raises(ShardingError, match="the tensor-parallel graph is inconsistent") as info:
        PassRunner(passes)(cap.gm)
    assert "in pass 'check_local_shapes' (after widen_view, slice_writes_to_cat, tensor_parallel" in "\n".join(info.value.__notes__)


def test_requires_names_the_missing_property_and_the_order():
    p1 = Pass("a", lambda gm: gm, ensures={"x"})
    p2 = Pass("b", lambda gm: gm, requires={"x", "y"})
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(PassError, match=r"pass 'b' requires \['y'\], which no pass before it ensures \(after a\)"):
        PassRunner([p1, p2])(gm)
    PassRunner([p1, p2], given={"y"})(gm)


def test_a_pass_that_raises_is_named():
    def boom(gm):
        raise KeyError("missing rule")
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(PassError, match=r"pass 'boom' failed \(the first pass\): KeyError"):
        PassRunner([Pass("boom", boom)])(gm)


def test_parallelize_runs_the_same_list():
    """parallelize's timings name each pass of rank_passes: one list, not a second pipeline."""
    name = "gpt"
    pm = fxmegatron.parallelize(models.build(name, n_layer=2), None, models.batch(name, batch_size=2))
    assert [k for k in pm.timings if k not in ("capture_s", "materialize_s")] == \
        ["slice_writes_to_cat_s", "tensor_parallel_s", "loss_reads_logits_dtype_s", "loss_grad_reuses_logits_s", "attention_rewrites_s",
         "drop_trivial_collectives_s", "counter_rng_s", "localize_s", "check_local_shapes_s",
         "recompute_s"]


def test_passes_name_the_tp_axis_and_materialisation_binds_the_group():
    """The passes write the mesh axis ("@tp") into the collectives; the group's name appears
    only once the program is materialised for a job (here a made-up group name)."""
    from fxmegatron.lower.rank_passes import TP_AXIS, groups
    from fxmegatron.ops.registry import record
    from fxmegatron.lower.materialize import materialize_graph

    cap = _captured()
    axes = {"dp": Axis(), "pp": Axis(), "tp": Axis(2, 0, "job-group-7", (0, 1))}
    local = PassRunner(rank_passes(cap, axes, ParallelConfig(sequence_parallel=True, recompute="full")))(cap.gm)

    def group_args(gm):
        """The group arguments of every communicating op (ops.registry) in ``gm`` and the graphs
        inside it."""
        return {n.args[i] for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
                if n.op == "call_function" and record(n.target) for i in record(n.target).group_args}

    assert group_args(local) == {TP_AXIS}
    bound = materialize_graph(local, cap, local.meta["fxmegatron/tp_plan"].param_plc, 0, 2, "meta",
                              source=cap.gm, groups=groups(axes))
    assert group_args(bound) == {"job-group-7"}
