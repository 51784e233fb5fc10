"""A Hugging Face model saved with ``save_pretrained`` (tiny, random) fine-tuned by ``fxmegatron train``
at pp2 x tp2, on a token file and on text through a saved HF tokenizer, then exported back with
``fxmegatron export``: the exported model, loaded with ``from_pretrained``, has the trainer's last
validation loss on the same held-out batches."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.families import FAMILIES
from tests.trainer_runs import ROOT, env, train, write_config

pytestmark = pytest.mark.slow


def save_llama(path):
    model = FAMILIES["llama"].build(n_layer=2)      # vocab 128, hidden 64, GQA, untied
    model.save_pretrained(path)
    return model


def held_out_loss(model_dir, cfg_path, batches):
    """The exported model's mean loss over the trainer's held-out batches (one process, eager)."""
    from transformers import AutoModelForCausalLM

    from fxmegatron.train.config import load as load_config
    from fxmegatron.train.setup import prepare
    prep = prepare(load_config(str(cfg_path)), None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, torch_dtype=torch.float32)
    model.train(False)
    with torch.no_grad():
        losses = [model(**prep.batch(w, "cpu")).loss.item() for w in prep.valid[:batches]]
    return sum(losses) / len(losses)


def test_finetune_pp2_tp2_and_export(tmp_path):
    model_dir = tmp_path / "llama"
    model = save_llama(model_dir)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    tokens = (rng.zipf(1.5, 40_000) % vocab).astype(np.uint16)       # a skewed, learnable distribution
    tokens.tofile(tmp_path / "train.bin")
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "ft.toml", {
        "run": {"out": str(out), "steps": 6, "seed": 0},
        "model": {"kind": "hf", "path": str(model_dir)},
        "data": {"kind": "tokens", "train": str(tmp_path / "train.bin"), "token_dtype": "uint16",
                 "seq_len": 16, "global_batch": 4},
        "layout": {"pp": 2, "tp": 2, "microbatches": 2},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "eval": {"batches": 2},
        "log": {"plot": False, "tensorboard": False},
    })
    dump = tmp_path / "dump"
    r = train(cfg, 4, "--dump", str(dump))
    assert r.returncode == 0, r.stdout
    # every rank's pipeline chunk: its graph and placements, and tp's collectives in its list
    assert f"the graph dump of every rank is in {dump}/rank*" in r.stdout, r.stdout
    for rank in range(4):       # (dp, pp, tp) = (1, 2, 2): ranks 0, 1 hold chunk 0, ranks 2, 3 chunk 1
        chunk = dump / f"rank{rank}" / f"chunk{rank // 2}"
        assert {"graph.py", "placements.txt", "collectives.txt"} <= set(os.listdir(chunk)), rank
        assert "reduce_from_tp" in (chunk / "collectives.txt").read_text(), rank
    with open(out / "loss.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    val = float(last["val_loss"])
    ckpt = out / "checkpoints" / "step-00000006"
    assert (ckpt / "index.json").exists(), os.listdir(out / "checkpoints")
    exported = tmp_path / "exported"
    e = subprocess.run([sys.executable, "-m", "fxmegatron.cli", "export", str(ckpt), str(exported)], cwd=ROOT,
                       env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert e.returncode == 0, e.stdout
    got = held_out_loss(str(exported), cfg, 2)
    assert abs(got - val) <= 1e-5 * abs(val), (got, val)
    # the weights moved: the exported model is the fine-tuned one, not the original
    from transformers import AutoModelForCausalLM
    after = AutoModelForCausalLM.from_pretrained(str(exported), local_files_only=True)
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(after.state_dict()[name], model.state_dict()[name])
