"""``fxmegatron export``: a checkpoint saved at pp2 x tp2 by a model the trainer loaded from a
save_pretrained folder (a Llama with GQA and a tied embedding and LM head, which both pipeline
ranks hold) comes back as a folder ``from_pretrained`` loads, with exactly the parallel
model's weights and its loss; an untied Llama and the bundled GPT in one process; tokenizer
files; the errors."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fxmegatron.errors import ExportError
from fxmegatron.train.export import export_checkpoint, main
from fxmegatron.train.models import load_model
from tests.distributed import run_distributed
from tests.families import FAMILIES
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
    os.makedirs(os.path.join(ckpt, "tokenizer"))
    with open(os.path.join(ckpt, "tokenizer", "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0"}')
    dest, back = _check_hf_export(root, ckpt, results[0], TIED)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(os.path.join(dest, "model.safetensors"))   # as transformers writes it
    assert open(os.path.join(dest, "tokenizer.json")).read() == '{"version": "1.0"}'


def test_untied_export_is_the_model(untied_one_process):
    root, ckpt, r0 = untied_one_process
    assert r0["same_local"]
    _check_hf_export(root, ckpt, r0, {})


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
