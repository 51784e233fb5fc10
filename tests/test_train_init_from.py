"""``model.init_from``: a run trained at pp 2 (torchrun, gloo, CPU) and exported; a new run at
another layout (one process; tp 2) started from the exported folder, or from the checkpoint
itself (each pipeline rank's file, read and cut for tp 2), evaluates the
held-out split before its first update (lr 0, one step) to the first run's final held-out loss,
and both to the loss of the exported weights computed here in eager. A folder of another model
is one ConfigError naming the parameter; a checkpoint of the run itself wins over init_from. An HF
run takes another save_pretrained folder's weights.
``fxmegatron verify --dump``: the files ``fxmegatron train --dump`` writes, per layout."""
import os
import re

import pytest
import torch

from fxmegatron.cli import main as cli_main
from fxmegatron.errors import ConfigError
from fxmegatron.models.gpt import GPT, GPTConfig
from fxmegatron.train.config import load
from fxmegatron.train.export import export_checkpoint
from fxmegatron.train.models import load_model
from fxmegatron.train.setup import prepare
from tests.trainer_runs import TINY, rows, train, write_config

pytestmark = pytest.mark.slow

GPT_OPTIONS = {"n_layer": 2, "n_head": 2, "n_embd": 32}    # tied embedding and LM head (GPTConfig's default)


def config(tmp, name, layout, steps=3, lr=3e-3, seed=3, gpt=None, **model):
    return write_config(tmp / f"{name}.toml", {
        "run": {"out": str(tmp / name), "steps": steps, "seed": seed},
        "model": {"kind": "gpt", **model, "gpt": {**GPT_OPTIONS, **(gpt or {})}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 4},
        "layout": layout,
        "optim": {"lr": lr, "min_lr": 0.0, "warmup_steps": 0},
        "eval": {"batches": 2},
        "log": {"plot": False, "tensorboard": False},
    })


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 steps at pp 2 (its graphs dumped), exported; the final held-out loss from loss.csv."""
    tmp = tmp_path_factory.mktemp("init_from")
    cfg = config(tmp, "first", {"pp": 2})
    r = train(cfg, 2, "--dump", str(tmp / "train_dump"))
    assert r.returncode == 0, r.stdout
    ckpt = str(tmp / "first" / "checkpoints" / "step-00000003")
    exported = export_checkpoint(ckpt, str(tmp / "exported"))
    return tmp, cfg, ckpt, exported, float(rows(tmp / "first")[-1]["val_loss"])


def eager_val_loss(cfg_path, folder):
    """The held-out loss of the weights in an exported ``folder``, by the bundled GPT in eager on
    the run's own held-out windows: no parallelize, no trainer loop."""
    prep = prepare(load(str(cfg_path)), None)
    src = load_model("gpt", folder, {}, torch.float32)
    model = GPT(GPTConfig(**src.describe["gpt_config"]))
    model.load_state_dict(dict(src.state_dict), strict=True)   # the tied head read from the embedding
    model.eval()
    with torch.no_grad():
        losses = [model(w[:, :-1], w[:, 1:]).item() for w in prep.valid]
    return sum(losses) / len(losses)


def first_val(tmp, cfg, nproc):
    """The held-out loss a run reports after one step at lr 0: its weights' before any update."""
    r = train(cfg, nproc)
    assert r.returncode == 0, r.stdout
    rs = rows(tmp)
    assert [int(x["step"]) for x in rs] == [1] and float(rs[0]["lr"]) == 0.0, rs
    return float(rs[0]["val_loss"]), r.stdout


def test_init_from_the_exported_folder_at_one_process(trained):
    tmp, _, _, exported, final = trained
    cfg = config(tmp, "from_export", {}, steps=1, lr=0.0, seed=11, init_from=exported)
    expected = eager_val_loss(cfg, exported)
    assert abs(final - expected) <= 1e-5, (final, expected)
    got, log = first_val(tmp / "from_export", cfg, 1)
    assert f"weights from {exported} (model.init_from)" in log, log
    assert abs(got - expected) <= 1e-5, (got, expected, final)
    # run on: its own checkpoint (step 1) wins over init_from
    r = train(cfg, 1, "--set", "run.steps=2")
    assert r.returncode == 0, r.stdout
    assert f"resumed from {tmp / 'from_export' / 'checkpoints' / 'step-00000001'} at step 1" in r.stdout, r.stdout
    assert f"model.init_from {exported} not read: this run has a checkpoint to resume from" in r.stdout
    assert [int(x["step"]) for x in rows(tmp / "from_export")] == [1, 2]


def test_init_from_the_checkpoint_at_tp2(trained):
    tmp, _, ckpt, exported, final = trained
    cfg = config(tmp, "from_ckpt", {"tp": 2}, steps=1, lr=0.0, seed=11, init_from=ckpt)
    got, log = first_val(tmp / "from_ckpt", cfg, 2)
    assert "tp=2" in log and f"weights from {ckpt}" in log, log
    assert abs(got - final) <= 1e-5, (got, final)
    assert abs(got - eager_val_loss(cfg, exported)) <= 1e-5


def test_a_folder_of_another_model_is_one_error_naming_the_parameter(trained):
    tmp, _, ckpt, exported, _ = trained

    def error(folder, gpt=None):
        cfg = config(tmp, "other", {}, steps=1, init_from=folder, gpt=gpt)
        with pytest.raises(ConfigError) as e:
            prepare(load(cfg), None)
        assert str(e.value).startswith(f"{cfg}: model.init_from {folder}"), e.value
        return str(e.value)

    assert "the checkpoint has no parameter 'blocks.2." in error(ckpt, {"n_layer": 3})
    assert "the checkpoint's parameter 'blocks.1." in error(ckpt, {"n_layer": 1})
    assert re.search(r"the checkpoint's '\w+\.weight' has shape \[\d+, 32\]; in the config's model \(GPT\) it is "
                     r"\[\d+, 48\]",
                     error(ckpt, {"n_embd": 48}))
    assert "no tensor 'blocks.2." in error(exported, {"n_layer": 3})
    assert re.search(r"tensor '[\w.]+' has shape \[\d+, 32\]; GPT's [\w.]+ has \[\d+, 48\]",
                     error(exported, {"n_embd": 48}))
    assert "is not a folder" in error(str(tmp / "nowhere"))
    assert f"is a folder of checkpoints, not one: name one of them, e.g. the latest, {ckpt}" in \
        error(os.path.dirname(ckpt))


def test_a_checkpoint_of_the_run_itself_wins(trained):
    """init_from names a folder of another model, so reading it would fail: with a checkpoint to
    resume from in checkpoint.dir it is not read at all."""
    tmp, first_cfg, ckpt, _, _ = trained
    other = ['model.init_from = "' + ckpt + '"', "model.gpt.n_layer = 3"]
    prep = prepare(load(first_cfg, other), None)        # the first run's own checkpoints are there
    assert prep.source.state_dict is None
    with pytest.raises(ConfigError, match="no parameter 'blocks.2."):
        prepare(load(first_cfg, other + ['checkpoint.resume = "none"']), None)


def test_init_from_a_save_pretrained_folder(tmp_path):
    """kind = "hf": the architecture from model.path (a config.json alone: its weights are not
    read), the weights from another save_pretrained folder, each rank's slice read from it."""
    import numpy as np
    from fxmegatron.placement import Shard, take_shard
    from tests.families import FAMILIES
    FAMILIES["llama"].build(seed=1).save_pretrained(tmp_path / "a")
    os.makedirs(tmp_path / "config_only")
    os.replace(tmp_path / "a" / "config.json", tmp_path / "config_only" / "config.json")
    want = FAMILIES["llama"].build(seed=2)
    want.save_pretrained(tmp_path / "b")
    FAMILIES["llama"].build(n_layer=3).save_pretrained(tmp_path / "deeper")
    (np.arange(4000) % 100).astype(np.uint16).tofile(tmp_path / "train.bin")

    def prepared(folder):
        return prepare(load(write_config(tmp_path / "hf.toml", {
            "run": {"out": str(tmp_path / "run"), "steps": 1},
            "model": {"kind": "hf", "path": str(tmp_path / "config_only"), "init_from": str(folder)},
            "data": {"kind": "tokens", "train": str(tmp_path / "train.bin"), "seq_len": 16, "global_batch": 4}})),
            None)

    state = prepared(tmp_path / "b").source.state_dict
    sd = want.state_dict()
    assert sorted(state) == sorted(sd)
    assert all(torch.equal(state[k], v) for k, v in sd.items())
    w = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(state.read_shard(w, Shard(1), 1, 2), take_shard(sd[w], Shard(1), 1, 2))
    with pytest.raises(ConfigError, match=r"model.init_from .*deeper: .*tensor 'model.layers.2.[\w.]+' is not a "
                                          r"parameter or buffer of LlamaForCausalLM"):
        prepared(tmp_path / "deeper")


def _normalised(path):
    with open(path) as f:       # a job's collectives name its process groups, verify's their mesh axes
        return re.sub(r"'(\d+|tp|cp|dp_cp|dp_replicate)'", "GROUP", f.read())


def test_verify_dump_writes_what_train_dump_writes(trained, capsys):
    tmp, first_cfg, _, _, _ = trained
    out = tmp / "verify_dump"
    assert cli_main(["verify", first_cfg, "--dump", str(out)]) == 0
    assert "verify tp=1 pp=2: exact" in capsys.readouterr().out
    for rank in (0, 1):     # pipeline rank r holds chunk r
        mine = out / "tp=1_pp=2" / f"rank{rank}" / f"chunk{rank}"
        job = tmp / "train_dump" / f"rank{rank}" / f"chunk{rank}"
        assert sorted(os.listdir(mine)) == sorted(os.listdir(job)) == \
            ["collectives.txt", "graph.py", "placements.txt", "plan.txt"]
        for name in ("graph.py", "placements.txt", "plan.txt", "collectives.txt"):
            assert _normalised(mine / name) == _normalised(job / name), (rank, name)
        plan = (mine / "plan.txt").read_text()
        assert f"pp: 2 (rank {rank})" in plan and "schedule: 1f1b p=2" in plan
        assert ("return (cross_entropy_loss,)" in (mine / "graph.py").read_text()) == (rank == 1)


def test_verify_dump_of_factory_layouts(tmp_path, capsys):
    rc = cli_main(["verify", "--factory", "tests/factories/gpt_small.py:build", "--tp", "2", "--pp", "1,2",
                   "--microbatches", "2", "--dump", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["tp=2_m=2", "tp=2_pp=2_m=2"]
    assert sorted(os.listdir(tmp_path / "tp=2_pp=2_m=2")) == ["rank0", "rank1", "rank2", "rank3"]
    # the mesh's order, tp fastest: ranks 2 and 3 are pipeline rank 1, holding the second chunk
    for rank, (pp, tp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        plan = (tmp_path / "tp=2_pp=2_m=2" / f"rank{rank}" / f"chunk{pp}" / "plan.txt").read_text()
        assert f"tp: 2 (rank {tp})" in plan and f"pp: 2 (rank {pp})" in plan and "schedule: 1f1b" in plan
    last = (tmp_path / "tp=2_pp=2_m=2" / "rank3" / "chunk1" / "graph.py").read_text()
    assert "vocab_parallel_cross_entropy" in last or "cross_entropy" in last
