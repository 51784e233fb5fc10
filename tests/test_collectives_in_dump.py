"""The dump of a 2-layer model at tp=2 shows exactly Megatron's collectives:
one f and one g per attention block and per MLP block, the embedding's g, and the
LM head's f with the vocab-parallel loss; nothing more."""
import re

import pytest

from fxmegatron.io.dump import collective_nodes, write_dump
from tests import models
from tests.helpers import transform


def _block_of(path):
    m = re.match(r"(.*?\.\d+)\.", path + ".")
    return m.group(1) if m else ""


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_collective_count_two_layers(name, tmp_path):
    model = models.build(name, n_layer=2)
    _, plan, gm = transform(model, models.batch(name), tp=2)
    write_dump(str(tmp_path), gm, {})
    listed = (tmp_path / "collectives.txt").read_text().splitlines()
    found = collective_nodes(gm)
    assert len(listed) == len(found)

    per_block = {}
    outside = []
    for node, kind in found:
        users = [u for u in node.users] if kind == "f" else [node]
        # f belongs where its consumers are (the first matmuls of the block)
        from fxmegatron.capture import module_path
        path = module_path(users[0])
        block = _block_of(path)
        (per_block.setdefault(block, []) if block else outside).append(kind)
    blocks = sorted(per_block)
    assert len(blocks) == 2, per_block
    for b in blocks:
        # attention: f ... g, then MLP: f ... g
        assert per_block[b] == ["f", "g", "f", "g"], (b, per_block[b])
    kinds = [k.split("[")[0] for k in outside]
    assert kinds == ["g", "f", "vocab_parallel_cross_entropy"], outside
    # 2 column + 2 row matmul groups per block; the loss is vocab-parallel
    assert sum(d.kind == "row" for d in plan.decisions.values()) == 4
    assert sum(d.kind == "vocab" for d in plan.decisions.values()) == 2


def test_dump_lists_placements_and_decisions(tmp_path):
    model = models.build("gpt2")
    _, _, gm = transform(model, models.batch("gpt2"), tp=2)
    write_dump(str(tmp_path), gm, {"tp": "2"})
    table = (tmp_path / "placements.txt").read_text()
    assert "S(1, blocks=[64, 64, 64])" in table       # fused QKV split per block
    assert "reduce_from_tp" in (tmp_path / "graph.py").read_text()
    plan = (tmp_path / "plan.txt").read_text()
    assert "transformer.wpe" in plan and "replicated: its indices are computed" in plan


# ---- the listing, byte for byte, against one recorded before the ops moved to one registry ----------
DUMP_LAYOUTS = {    # name in tests/data/collectives_dump.txt: (model, mesh sizes, ParallelConfig's options)
    "gpt tp2": ("gpt", {"tp": 2}, {}),
    "gpt2 tp2 sp": ("gpt2", {"tp": 2}, {"sequence_parallel": True}),
    "llama tp2 sp recompute": ("llama", {"tp": 2}, {"sequence_parallel": True, "recompute": "selective"}),
    "llama cp2": ("llama", {"cp": 2}, {}),
    "gpt cp2 tp2 sp": ("gpt", {"cp": 2, "tp": 2}, {"sequence_parallel": True}),
    "gpt tp2 sp overlap": ("gpt", {"tp": 2}, {"sequence_parallel": True, "tp_comm_overlap": 2}),
    "gpt tp2 sp fp8": ("gpt", {"tp": 2}, {"sequence_parallel": True, "precision": "fp8"}),
    "gpt tp2 fp8 rowwise": ("gpt", {"tp": 2}, {"precision": "fp8", "fp8_recipe": "rowwise"}),
    "gpt tp1 fp8": ("gpt", {}, {"precision": "fp8"}),      # fp8 amaxes over no group: not listed
    "falcon tp2 sp fp8 attention": ("falcon", {"tp": 2}, {"sequence_parallel": True, "precision": "fp8",
                                                         "fp8_policy": "attention"}),
}


def _recorded():
    """{layout: its collectives.txt} from tests/data/collectives_dump.txt (lines keep their
    trailing spaces: the module column of a node outside any module is empty)."""
    import os
    path = os.path.join(os.path.dirname(__file__), "data", "collectives_dump.txt")
    out, name = {}, None
    with open(path, encoding="utf-8", newline="") as f:
        for line in f:
            if line.startswith("## "):
                name = line[3:].rstrip("\n")
                out[name] = ""
            elif name is not None:
                out[name] += line
    return out


def _rank0_graph(name, sizes, options):
    """Rank 0's graph after every pass of ``rank_passes`` (no process group: the collectives
    name the mesh axes)."""
    from fxmegatron.capture import capture
    from fxmegatron.lower.rank_passes import rank_passes
    from fxmegatron.config import ParallelConfig
    from fxmegatron.mesh import Axis
    from fxmegatron.passes.runner import PassRunner
    from tests.test_fp8_pass import model_and_batch

    model, batch = model_and_batch(name) if name == "falcon" else \
        (models.build(name, n_layer=2), models.batch(name, batch_size=2))
    cap = capture(model, batch)
    axes = {d: Axis() for d in ("dp", "pp", "tp", "cp")}
    axes.update({d: Axis(s, 0, f"job-{d}", tuple(range(s))) for d, s in sizes.items()})
    return PassRunner(rank_passes(cap, axes, ParallelConfig(**options)))(cap.gm)


@pytest.mark.parametrize("layout", list(DUMP_LAYOUTS))
def test_dump_collectives_listing_is_unchanged(layout, tmp_path):
    """f/g and the sequence collectives, the merged linears of tp_comm_overlap, context
    parallelism's ops (the ring's steps under each attention), the FP8 amax reductions (only
    over a group) and gathers, the vocab-parallel loss, and the ``mean_grad`` of each weight
    whose gradient every tp rank computes alone (``passes.tensor_parallel.same_grads``): each
    layout's listing is the one recorded before the ops were described by one registry, with
    those ``mean_grad`` lines added since."""
    gm = _rank0_graph(*DUMP_LAYOUTS[layout])
    write_dump(str(tmp_path), gm, {})
    with open(tmp_path / "collectives.txt", encoding="utf-8", newline="") as f:
        assert f.read() == _recorded()[layout]


# ---- the registry of communicating ops ------------------------------------------------------------
OP_MODULES = ["collectives", "overlapped_linear", "context_parallel", "vocab_parallel", "fp8", "fp8_operands",
              "fp8_gather", "dp_gather"]


def _records():
    import importlib

    from fxmegatron.ops.registry import records
    for m in OP_MODULES:
        importlib.import_module(f"fxmegatron.ops.{m}")
    return records()


def _parameter_names(op):
    import inspect
    schema = getattr(op, "_schema", None)      # an OpOverload (cp_attention)
    if schema is not None:
        return [a.name for a in schema.arguments]
    return list(inspect.signature(op).parameters)


def test_every_communicating_op_has_one_record_where_it_is_defined():
    recs = _records()
    assert sorted(r.label for r in recs) == sorted([
        "f", "g", "max", "gather_seq", "scatter_seq", "split_seq", "all_gather_seq",
        "all_gather+linears", "linear+reduce_scatter", "cp_attention", "cp_sum", "cp_count",
        "vocab_parallel_cross_entropy[max,g,g]", "fp8_amax", "fp8_amax", "fp8_amax", "fp8_gather_seq",
        "gather_seq_grad", "all_gather_seq_grad", "unshard", "mean_grad"])
    for r in recs:
        module = getattr(r.op, "__module__", None) or ""
        assert module.startswith("fxmegatron.ops.") or module == "torch._ops.fxmegatron", (r.name, module)
        assert r.description and r.group_args, r.name
        names = _parameter_names(r.op)
        assert all("group" in names[i] for i in r.group_args), (r.name, names, r.group_args)
    # dropped at tp=1 (passes.trivial_collectives): the tensor-parallel collectives alone
    assert {r.name for r in recs if r.identity_alone} == {"f", "g", "max", "gather_seq", "scatter_seq", "split_seq",
                                                          "all_gather_seq", "mean_grad"}


def test_a_second_record_of_one_op_is_refused():
    from fxmegatron.ops.collectives import copy_to_tp
    from fxmegatron.ops.registry import register
    _records()
    with pytest.raises(ValueError, match="registered already, as 'f'"):
        register(copy_to_tp, "f2", "again", (1,))
