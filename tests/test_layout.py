"""``Layout`` is the one list of a layout's options: ``parallelize``'s keywords, the trainer's
``[layout]`` keys, ``verify``'s layout, the dry-run plan's and the command line's flags are
checked against its fields here, each surface with its deliberate exceptions listed (and
why) below. A new option added to one surface and not to ``Layout`` (or the reverse) fails
one of the ``test_*_agree`` tests, naming the option.

Then: the validation ``Layout`` does once, and ``describe()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
import torch

import fxmegatron
from fxmegatron.errors import PrecisionError, ScheduleError, ShardingError
from fxmegatron.layout import DEGREES, Layout, default_schedule
from fxmegatron.train import config as train_config
from fxmegatron.train.plan import PLANNED
from fxmegatron.verify import VERIFIED

FIELDS = {f.name for f in dataclasses.fields(Layout)}

# ---- the deliberate exceptions, per surface ------------------------------------------------------
# parallelize reads the degrees from the mesh; chunked is the private ``_chunked`` (compile's stage
# folders, which need the pipeline form at pp=1)
PARALLELIZE_NOT_KEYWORDS = set(DEGREES) | {"chunked"}
PARALLELIZE_RENAMED = {"_chunked": "chunked"}
# the trainer: state_dict comes from model.kind/model.path, seed is run.seed, grad_accum_dtype
# follows from run.precision (fp32 sums of bf16 gradients), verbose/verify/min_split are
# parallelize's checks and prints, chunked is compile's
TRAINER_NOT_KEYS = {"state_dict", "seed", "grad_accum_dtype", "verbose", "verify", "min_split", "chunked"}
# trainer keys that are another field's name: layout.overlap, tp_comm_overlap's first name
TRAINER_ALIASES = {"overlap": "tp_comm_overlap"}
# the command line's flags (``Layout.add_arguments``): run fields and chunked (compile always writes
# chunks) have none; seed is a flag of its own where a command takes it
FLAGS_NOT = {"state_dict", "seed", "verbose", "verify", "min_split", "chunked"}
# ``fxmegatron compile`` (cli.FOLDER_OPTIONS): its mesh is pp × tp, and a stage folder is the
# generated source of plain ATen chunks: fused kernels, torch.compile, FP8, tp_comm_overlap's
# merged linears, cp and the gradient sums' dtype have no written form
COMPILE_NOT_FLAGS = FLAGS_NOT | {"dp", "cp", "cp_attention", "dp_shard", "dp_replicate", "ep", "moe_capacity_factor",
                                 "fuse", "compile", "tp_comm_overlap",
                                 "tp_comm_transport", "precision", "fp8_recipe", "fp8_policy", "grad_accum_dtype"}
COMPILE_OTHER_FLAGS = {"factory", "out", "seed"}
# verify simulates dp, pp, cp and tp ranks in one process on the CPU: the kernels (fuse, compile),
# fp8 (which eager does not run) and tp_comm_overlap have no simulated form, nor has hybrid
# sharding yet (dp_replicate: the replica groups' sum of the shards' gradients); the run fields
# but seed are parallelize's; an MoE capacity factor drops what eager runs dropless
VERIFY_NOT_SIMULATED = {"moe_capacity_factor", "fuse", "compile", "tp_comm_overlap", "tp_comm_transport",
                        "precision", "fp8_recipe", "fp8_policy", "grad_accum_dtype", "chunked", "state_dict",
                        "verbose", "verify", "min_split"}
VERIFY_OTHER_KEYWORDS = {"batch", "loss_rtol", "grad_rtol", "layout"}
# the dry-run plan counts what a rank holds and saves: the kernels and communication options do
# not change it; the run fields are parallelize's; dp_shard is a keyword of its own (below), and
# dp_replicate is read from the layout handed in (the trainer's --dry-run), where it divides the shards
# ep: the trainer's --dry-run refuses ep > 1 (plan_run does not count the experts' shards yet)
# moe_capacity_factor: a mask of the routing weights, no tensor a rank holds changes size
PLAN_LEFT_OUT = {"moe_capacity_factor",
                 "fuse", "dp_shard", "dp_replicate", "compile", "tp_comm_overlap", "tp_comm_transport", "precision", "fp8_recipe",
                 "fp8_policy", "chunked", "state_dict", "seed", "verbose", "verify", "min_split"}
# dp_shard: a keyword of plan_run that scales the bytes per rank, not a field the plan builds its graph with
PLAN_OTHER_KEYWORDS = {"param_dtype", "optimizer", "device", "picture", "layout", "dp_shard"}


def _diff(surface: set, expected: set, what: str) -> str:
    extra, missing = sorted(surface - expected), sorted(expected - surface)
    return (f"{what}: has {extra}, which are not Layout fields (or are listed as this surface's exceptions); "
            f"lacks the Layout fields {missing}")


def test_parallelize_keywords_agree():
    params = inspect.signature(fxmegatron.parallelize).parameters
    kw = {PARALLELIZE_RENAMED.get(n, n) for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    expected = FIELDS - PARALLELIZE_NOT_KEYWORDS | {"chunked"}
    assert kw == expected, _diff(kw, expected, "parallelize's keywords")
    # and with the same defaults
    for f in dataclasses.fields(Layout):
        name = "_chunked" if f.name == "chunked" else f.name
        if name in params:
            assert params[name].default == f.default, f"parallelize({name}=) default differs from Layout's"


def test_layout_options_are_parallelize_keywords():
    params = inspect.signature(fxmegatron.parallelize).parameters
    assert set(Layout().options()) <= set(params)


def test_trainer_keys_agree():
    keys = {TRAINER_ALIASES.get(k.name, k.name) for k in train_config.KEYS if k.section == "layout"}
    expected = FIELDS - TRAINER_NOT_KEYS
    assert keys == expected, _diff(keys, expected, "the trainer's [layout] keys")


def test_trainer_defaults_are_the_layouts():
    """A [layout] key left out must mean Layout's default (the trainer writes its defaults into
    the table): each key's default is its field's, or the TOML spelling of it (TOML_EMPTY)."""
    from fxmegatron.layout import TOML_EMPTY
    defaults = {f.name: f.default for f in dataclasses.fields(Layout)}
    wrong = []
    for k in train_config.KEYS:
        name = TRAINER_ALIASES.get(k.name, k.name)
        if k.section != "layout" or name not in defaults:
            continue
        if k.default != defaults[name] and k.default != TOML_EMPTY.get(name, object()):
            wrong.append(f"layout.{k.name} = {k.default!r}, Layout.{name} = {defaults[name]!r}")
    assert not wrong, wrong
    table = {k.name: k.default for k in train_config.KEYS if k.section == "layout"}
    assert Layout.from_table(table) == Layout()


def _flags(parser) -> set:
    return {a.dest for a in parser._actions if a.dest != "help"}


def test_flags_agree():
    ap = argparse.ArgumentParser()
    Layout.add_arguments(ap)
    expected = FIELDS - FLAGS_NOT
    assert _flags(ap) == expected, _diff(_flags(ap), expected, "Layout.add_arguments's flags")


def test_compile_flags_agree(monkeypatch):
    from fxmegatron import cli
    seen = {}

    def parse(self, argv=None, namespace=None):       # the parser compile_main builds, not run
        seen["flags"] = _flags(self)
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(SystemExit):
        cli.compile_main([])
    flags = seen["flags"] - COMPILE_OTHER_FLAGS
    expected = FIELDS - COMPILE_NOT_FLAGS
    assert flags == expected, _diff(flags, expected, "fxmegatron compile's flags")
    assert set(cli.FOLDER_OPTIONS) == expected - set(DEGREES)


def test_verify_fields_agree():
    params = inspect.signature(fxmegatron.verify).parameters
    kw = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - VERIFY_OTHER_KEYWORDS
    expected = FIELDS - VERIFY_NOT_SIMULATED
    assert kw == expected, _diff(kw, expected, "verify's keywords")
    assert set(VERIFIED) == expected


def test_plan_fields_agree():
    from fxmegatron.train.plan import plan_run
    params = inspect.signature(plan_run).parameters
    kw = set(list(params)[2:]) - PLAN_OTHER_KEYWORDS
    expected = FIELDS - PLAN_LEFT_OUT
    assert kw == expected, _diff(kw, expected, "plan_run's keywords")
    assert set(PLANNED) == expected


def test_every_exception_names_a_field():
    for listed in (PARALLELIZE_NOT_KEYWORDS, TRAINER_NOT_KEYS, FLAGS_NOT, COMPILE_NOT_FLAGS, VERIFY_NOT_SIMULATED,
                   PLAN_LEFT_OUT, set(TRAINER_ALIASES.values())):
        assert listed <= FIELDS, sorted(listed - FIELDS)


# ---- the constructors ---------------------------------------------------------------------------------
def test_from_table_reads_the_trainer_layout():
    cfg = train_config.from_dict({"run": {"steps": 1}, "data": {"train": "x", "seq_len": 8, "global_batch": 8},
                                  "layout": {"tp": 2, "sequence_parallel": True, "overlap": 2, "pp": 2,
                                             "blocks_per_chunk": [1, 1], "microbatches": 2}})
    lay = Layout.from_table(cfg.layout.__dict__, seed=3)
    assert (lay.tp, lay.pp, lay.tp_comm_overlap, lay.blocks_per_chunk, lay.seed) == (2, 2, 2, (1, 1), 3)
    assert lay.schedule is None       # "" in TOML
    with pytest.raises(ShardingError, match="one option under two names"):
        Layout.from_table({**cfg.layout.__dict__, "tp_comm_overlap": 4})


def test_from_args_reads_the_flags():
    ap = argparse.ArgumentParser()
    Layout.add_arguments(ap)
    lay = Layout.from_args(ap.parse_args(["--tp", "2", "--sequence-parallel", "--tp-comm-overlap", "2",
                                          "--blocks-per-chunk", "2,1", "--compile", "--grad-accum-dtype",
                                          "float32"]))
    assert (lay.tp, lay.sequence_parallel, lay.tp_comm_overlap, lay.blocks_per_chunk, lay.compile,
            lay.grad_accum_dtype) == (2, True, 2, (2, 1), True, torch.float32)
    assert Layout.from_args(ap.parse_args([])) == Layout()


def test_from_axes_takes_the_mesh_degrees():
    from fxmegatron.mesh import Axis
    lay = Layout.from_axes({"dp": Axis(2), "pp": Axis(1), "tp": Axis(4), "dp_cp": Axis(2)}, microbatches=2)
    assert (lay.dp, lay.pp, lay.cp, lay.tp, lay.microbatches) == (2, 1, 1, 4, 2)
    assert Layout.from_mesh(None) == Layout()


# ---- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, error, match", [
    ({"tp_comm_overlap": 2}, ShardingError, r"tp_comm_overlap=2.*needs sequence_parallel=True"),
    ({"sequence_parallel": True, "tp_comm_overlap": -1}, ShardingError, r">= 0"),
    ({"tp_comm_transport": "nvlink"}, ShardingError, r"'copy_engine'"),
    ({"microbatches": 0}, ScheduleError, r"microbatches=0: must be >= 1"),
    ({"precision": "fp16"}, PrecisionError, r"precision='fp16'"),
    ({"precision": "fp8", "verify": True}, PrecisionError, r"verify compares"),
    ({"precision": "fp8", "sequence_parallel": True, "tp_comm_overlap": 2}, PrecisionError, r"no FP8 form"),
    ({"cp_attention": "p2p"}, ShardingError, r"'ring' or 'allgather'"),
    ({"tp": 0}, ShardingError, r"tp=0.*>= 1"),
    ({"pp": True}, ShardingError, r"pp=True"),
])
def test_validation(options, error, match):
    with pytest.raises(error, match=match):
        Layout(**options)


def test_unknown_recompute_names_itself():
    with pytest.raises(Exception, match="sometimes"):
        Layout(recompute="sometimes")


def test_schedule_default_and_check():
    assert default_schedule(1) == "1f1b" and default_schedule(2) == "interleaved"
    assert Layout(pp=2, microbatches=2).schedule_name() == "1f1b"
    assert Layout(pp=2, virtual_stages=2, microbatches=2).schedule_name() == "interleaved"
    assert Layout().schedule_name() == "" and Layout().make_schedule() is None
    assert Layout(pp=2, microbatches=4, schedule="gpipe").make_schedule().name == "gpipe"
    with pytest.raises(ScheduleError, match="needs a pipeline"):
        Layout(schedule="interleaved").make_schedule()


def test_blocks_per_chunk_becomes_a_tuple_and_the_layout_is_frozen_and_keywords_only():
    lay = Layout(pp=2, blocks_per_chunk=[1, 2])
    assert lay.blocks_per_chunk == (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.tp = 2
    with pytest.raises(TypeError):
        Layout(2, 1)      # verify's former Layout(tp, pp, ...): no silent dp=2


# ---- describe -----------------------------------------------------------------------------------------
def test_describe():
    assert Layout().describe() == "dp 1 × pp 1 × cp 1 × tp 1 = 1 ranks"
    lay = Layout(dp=2, pp=2, tp=2, sequence_parallel=True, recompute="full", microbatches=4, seed=7,
                 grad_accum_dtype=torch.float32)
    assert lay.describe() == ("dp 2 × pp 2 × cp 1 × tp 2 = 8 ranks; sequence_parallel; recompute full; "
                              "microbatches 4; grad_accum_dtype float32; schedule 1f1b")
    assert str(lay) == f"Layout({lay.describe()})"
    # the run's fields (seed, state_dict, ...) are not the layout's: not described
    assert "seed" not in lay.describe()
    fp8 = Layout(precision="fp8")
    assert fp8.describe() == "dp 1 × pp 1 × cp 1 × tp 1 = 1 ranks; precision fp8"
    assert "fp8_policy attention" in Layout(precision="fp8", fp8_policy="attention").describe()


def test_a_layout_the_trainer_refuses_is_a_config_error():
    from fxmegatron.errors import ConfigError
    from fxmegatron.train.setup import layout_of
    raw = {"run": {"steps": 1, "precision": "bf16"}, "data": {"train": "x", "seq_len": 8, "global_batch": 8}}
    cfg = train_config.from_dict({**raw, "layout": {"tp": 2, "tp_comm_overlap": 2}}, where="run.toml")
    with pytest.raises(ConfigError, match=r"run.toml: \[layout\]: .*needs sequence_parallel=True"):
        layout_of(cfg)
    cfg = train_config.from_dict({**raw, "layout": {"pp": 2, "microbatches": 2, "precision": "fp8",
                                                    "fp8_policy": ["mlp"]}}, where="run.toml")
    lay = layout_of(cfg)
    assert lay.precision == "fp8" and lay.grad_accum_dtype == torch.float32 and lay.seed == 0
    with pytest.raises(ConfigError, match="blocks_per_chunk must be a list of whole numbers"):
        train_config.from_dict({**raw, "layout": {"blocks_per_chunk": ["a"]}})


def test_build_rank_plans_or_builds_the_stages_asked_for():
    from fxmegatron.capture import capture
    from fxmegatron.lower.rank import build_rank
    from fxmegatron.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8, dropout=0.0))
    ids = torch.randint(0, 32, (2, 8))
    lay = Layout(pp=2, tp=2, microbatches=1)
    planned = build_rank(capture(model, (ids, ids)), lay, {"tp": 1}, None, {})
    assert len(planned.chunks) == 2 and not planned.stages and planned.whole is None
    built = build_rank(capture(model, (ids, ids)), lay, {"tp": 1, "pp": 1}, "cpu", {"tp": ""})
    assert list(built.stages) == [1] and set(built.specs) == {0}
    whole = build_rank(capture(model, (ids, ids)), Layout(tp=2), {"tp": 0}, "cpu", {"tp": ""})
    assert whole.chunks is None and whole.whole is not None and "materialize_s" in whole.timings
