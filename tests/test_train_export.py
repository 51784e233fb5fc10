"""``fxmegatron export``: a checkpoint saved at pp2 x tp2 by a model the trainer loaded from a
save_pretrained folder (a Llama with GQA and a tied embedding and LM head, which both pipeline
ranks hold) comes back as a folder ``from_pretrained`` loads, with exactly the parallel
model's weights and its loss; an untied Llama and the bundled GPT in one process; tokenizer
files; the errors."""
import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fxmegatron.errors import ExportError
from fxmegatron.io.checkpoint import read_full_state
from fxmegatron.train.export import export_checkpoint, main
from fxmegatron.train.models import load_model
from tests.distributed import run_distributed
from tests.families import FAMILIES
from tests.trainer_runs import tiny_tokenizer, train, write_config
from tests.workers.export import GPT_OPTIONS, load_step_save

TIED = {"tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tied_pp2_tp2(tmp_path_factory):
    """The tied Llama loaded, stepped and checkpointed at pp2 x tp2 on 4 processes."""
    root = tmp_path_factory.mktemp("export")
    src, ckpt = str(root / "src"), str(root / "ckpt")
    FAMILIES["llama"].build(**TIED).save_pretrained(src)
    results = run_distributed(load_step_save, 4, (1, 2, 2), "hf", src, {}, ckpt, "llama", TIED)
    return root, ckpt, results


@pytest.fixture(scope="module")
def untied_one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("export1")
    src, ckpt = str(root / "src"), str(root / "ckpt")
    FAMILIES["llama"].build().save_pretrained(src)
    return root, ckpt, load_step_save(0, 1, None, "hf", src, {}, ckpt, "llama")


def _loss(model, batch):
    model.train()
    with torch.no_grad():
        return model(**batch).loss.item()


def _check_hf_export(root, ckpt, r0, overrides):
    from transformers import AutoModelForCausalLM
    dest = str(root / "hf")
    assert main([ckpt, dest]) == 0
    back = AutoModelForCausalLM.from_pretrained(dest)
    sd = back.state_dict()
    assert sorted(sd) == sorted(r0["full"])
    assert all(torch.equal(sd[k], v) for k, v in r0["full"].items())
    ref = FAMILIES["llama"].build(**overrides)
    ref.load_state_dict(r0["full"], strict=True)
    assert abs(_loss(back, r0["batch"]) - _loss(ref, r0["batch"])) <= 1e-6
    assert abs(_loss(back, r0["batch"]) - r0["loss"]) <= 1e-5 * abs(r0["loss"])
    return dest, back


def test_pp2_tp2_tied_export_is_the_parallel_model(tied_pp2_tp2):
    root, ckpt, results = tied_pp2_tp2
    assert all(r["same_local"] for r in results), "read_shard gave other local parameters than the model in memory"
    assert any(r["split"] for r in results)
    assert "model.embed_tokens.weight" in results[0]["params"] and "lm_head.weight" not in results[0]["params"]
    tiny_tokenizer(os.path.join(ckpt, "tokenizer"), vocab=100)
    dest, back = _check_hf_export(root, ckpt, results[0], TIED)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(os.path.join(dest, "model.safetensors"))   # as transformers writes it
    from transformers import AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(dest)) == 100


def test_untied_export_is_the_model(untied_one_process):
    root, ckpt, r0 = untied_one_process
    assert r0["same_local"]
    _check_hf_export(root, ckpt, r0, {})


def test_tokenizer_folder_holding_the_original_model(untied_one_process, tmp_path):
    """A checkpoint written before the trainer kept only tokenizer files: its ``tokenizer/`` is the
    whole model folder of the fine-tune recipe, untrained weights and config.json included. The
    export takes the tokenizer from it and nothing else."""
    root, ckpt, r0 = untied_one_process
    old = shutil.copytree(ckpt, str(tmp_path / "old"))
    shutil.copytree(str(root / "src"), os.path.join(old, "tokenizer"))      # the original weights
    tiny_tokenizer(os.path.join(old, "tokenizer"), vocab=100)
    dest = export_checkpoint(old, str(tmp_path / "out"))
    got = load_file(os.path.join(dest, "model.safetensors"))
    assert sorted(got) == sorted(r0["full"]) and all(torch.equal(got[k], v) for k, v in r0["full"].items())


def test_export_checks_what_it_wrote(tmp_path, monkeypatch):
    """A folder whose weights are not the checkpoint's is an error, never a quiet success."""
    from fxmegatron.train import export
    ckpt = str(tmp_path / "ckpt")
    load_step_save(0, 1, None, "gpt", None, GPT_OPTIONS, ckpt)
    write = export._write_plain

    def write_other(state, out_dir, config):
        write({k: v + (k == "ln_f.weight") * 1e-3 for k, v in state.items()}, out_dir, config)
    monkeypatch.setattr(export, "_write_plain", write_other)
    with pytest.raises(ExportError, match=r"ln_f.weight as written differs from the checkpoint's"):
        export_checkpoint(ckpt, str(tmp_path / "gpt"))


def test_gpt_export_loads_back(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    r0 = load_step_save(0, 1, None, "gpt", None, GPT_OPTIONS, ckpt)
    dest = export_checkpoint(ckpt, str(tmp_path / "gpt"))
    cfg = json.load(open(os.path.join(dest, "config.json")))
    assert cfg["fxmegatron_model"] == "gpt" and cfg["gpt_config"]["n_layer"] == 2
    src = load_model("gpt", dest, {}, torch.float32)
    assert sorted(src.state_dict) == sorted(r0["full"])
    assert all(torch.equal(src.state_dict[k], v) for k, v in r0["full"].items())


def _edit_index(src, dest, edit):
    shutil.copytree(src, dest)
    path = os.path.join(dest, "index.json")
    index = json.load(open(path))
    edit(index)
    json.dump(index, open(path, "w"))
    return dest


def test_errors(untied_one_process, tmp_path):
    _, ckpt, _ = untied_one_process
    with pytest.raises(ExportError, match="no index.json"):
        export_checkpoint(str(tmp_path), str(tmp_path / "out"))
    bare = _edit_index(ckpt, str(tmp_path / "bare"), lambda ix: ix.update(extra={}))
    with pytest.raises(ExportError, match="no model description"):
        export_checkpoint(bare, str(tmp_path / "out"))
    assert main([bare, str(tmp_path / "out")]) == 1

    def as_gpt2(ix):      # a Llama checkpoint described as another model
        ix["extra"]["model"]["config"] = FAMILIES["gpt2"].config().to_dict()
    wrong = _edit_index(ckpt, str(tmp_path / "wrong"), as_gpt2)
    with pytest.raises(ExportError, match=r"the checkpoint has no parameter 'transformer\.w"):
        export_checkpoint(wrong, str(tmp_path / "out"))
    with pytest.raises(ExportError, match="the checkpoint itself"):
        export_checkpoint(ckpt, ckpt)


@pytest.mark.slow
def test_finetune_recipe_exports_the_trained_model(tmp_path):
    """docs/TRAINER.md's fine-tune recipe: ``data.tokenizer`` is the model's own folder (weights and
    config.json beside the tokenizer). The checkpoint keeps the tokenizer's files only, and the
    export is the trained model, not the folder's original weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model_dir = tmp_path / "llama"
    original = FAMILIES["llama"].build(n_layer=1)        # vocabulary 128
    original.save_pretrained(model_dir)
    tiny_tokenizer(model_dir, vocab=100)
    rng = random.Random(0)
    (tmp_path / "a.txt").write_text(" ".join(f"w{rng.randrange(98)}" for _ in range(2000)))
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "ft.toml", {
        "run": {"out": str(out), "steps": 2},
        "model": {"kind": "hf", "path": str(model_dir)},
        "data": {"tokenizer": str(model_dir), "train": [str(tmp_path / "a.txt")], "seq_len": 16, "global_batch": 4},
        "optim": {"lr": 1e-2},
        "eval": {"batches": 1},
        "log": {"plot": False, "tensorboard": False},
    })
    r = train(cfg, 1)
    assert r.returncode == 0, r.stdout
    ckpt = out / "checkpoints" / "step-00000002"
    assert sorted(os.listdir(ckpt / "tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]
    dest = tmp_path / "exported"
    assert main([str(ckpt), str(dest)]) == 0
    trained, got = read_full_state(str(ckpt)), AutoModelForCausalLM.from_pretrained(dest).state_dict()
    assert all(torch.equal(got[k], v) for k, v in trained.items())
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(got[name], original.state_dict()[name])
    assert len(AutoTokenizer.from_pretrained(dest)) == 100
