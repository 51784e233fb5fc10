"""``data.document_mask``: packed documents computed as if each were alone. The masks, positions
and ignored labels of a hand-made window; a tiny HF Llama's logits and loss on a packed window
against each document run alone; the trainer's batches under tp2 and tp2 + SP exact by
``verify``; the configs it refuses."""
import json
import os

import pytest
import torch

from fxmegatron.errors import ConfigError
from fxmegatron.train.config import load
from fxmegatron.train.doc_mask import document_inputs, hf_batch
from tests.families import FAMILIES
from tests.trainer_runs import tiny_tokenizer, write_config

EOS = 1


def test_masks_positions_and_ignored_labels_of_a_window():
    x = torch.tensor([[7, 8, EOS, 9, EOS, 4, 5, 6]])      # a document ends at 2 and at 4
    mask, pos, starts = document_inputs(x, EOS)
    doc = [0, 0, 0, 1, 1, 2, 2, 2]
    want = torch.tensor([[j <= i and doc[j] == doc[i] for j in range(8)] for i in range(8)])
    assert torch.equal(mask[0, 0], want)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert starts.tolist() == [[False, False, False, True, False, True, False, False]]
    b = hf_batch(x, x.clone(), EOS)
    assert b["labels"].tolist() == [[7, 8, EOS, -100, EOS, -100, 5, 6]]
    assert b["attention_mask"].shape == (1, 1, 8, 8) and torch.equal(b["position_ids"], pos)


@pytest.mark.parametrize("family", ["llama", "gpt2"])     # rotary positions, and learned absolute ones
def test_a_packed_window_is_each_document_alone(family):
    torch.manual_seed(0)
    model = FAMILIES[family].build(n_layer=2).eval()
    docs = [[5, 9, 12, 40, EOS], [33, 7, EOS], [80, 81, 82, 83, 84, 85, EOS], [60, 61, 62]]   # the last one cut
    x = torch.tensor([sum(docs, [])])
    batch = hf_batch(x, x.clone(), EOS)
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        packed = model(**batch)
        at, losses = 0, []
        for d in docs:
            alone = model(input_ids=torch.tensor([d])).logits[0]
            torch.testing.assert_close(packed.logits[0, at:at + len(d)], alone, rtol=1e-5, atol=1e-5)
            losses.append(ce(alone[:-1], torch.tensor(d[1:]), reduction="sum"))
            at += len(d)
    counted = sum(len(d) - 1 for d in docs)
    assert abs(packed.loss.item() - (sum(losses) / counted).item()) <= 1e-5
    with torch.no_grad():      # without the mask the later documents read the earlier ones
        plain = model(input_ids=x).logits
    assert (plain[0, 5:8] - packed.logits[0, 5:8]).abs().max() > 1e-3


@pytest.fixture
def hf_run(tmp_path):
    folder = tmp_path / "llama"
    FAMILIES["llama"].build(n_layer=1).save_pretrained(folder)
    tiny_tokenizer(folder, vocab=100)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": " ".join(f"w{(i * 7 + k) % 98}" for k in range(3 + i % 5))}) + "\n")
    return tmp_path, {"run": {"out": str(tmp_path / "out"), "steps": 2},
                      "model": {"kind": "hf", "path": str(folder)},
                      "data": {"kind": "jsonl", "tokenizer": str(folder), "train": str(tmp_path / "docs.jsonl"),
                               "seq_len": 16, "global_batch": 4, "document_mask": True},
                      "layout": {"tp": 2}}


def test_the_trainers_batches_are_exact_at_tp2(hf_run):
    from fxmegatron.cli import _with_weights
    from fxmegatron.layout import Layout
    from fxmegatron.train.setup import prepare
    from fxmegatron.verify import verify
    tmp, raw = hf_run
    prep = prepare(load(write_config(tmp / "c.toml", raw)), None)
    batch = prep.batch(prep.train.windows(0), "cpu")
    x = batch["input_ids"]
    assert (x == EOS).sum() > 0 and batch["position_ids"].min() == 0
    mask, pos, _ = document_inputs(x, EOS)
    assert torch.equal(batch["attention_mask"], mask) and torch.equal(batch["position_ids"], pos)
    model = _with_weights(prep, batch)
    for sp in (False, True):
        report = verify(model, batch, layout=Layout(tp=2, sequence_parallel=sp))
        assert "exact" in str(report), report


@pytest.mark.parametrize("change, says", [
    ({"model": {"kind": "gpt", "path": ""}}, "only a Hugging Face model's forward takes"),
    ({"data": {"tokenizer": "bytes"}}, r"needs data.tokenizer to be one \(not 'bytes'\)"),
    ({"layout": {"tp": 1, "cp": 2}}, "context parallelism"),
])
def test_what_it_refuses(hf_run, change, says):
    from fxmegatron.train.setup import prepare
    tmp, raw = hf_run
    for section, values in change.items():
        raw[section] = {**raw[section], **values}
    if raw["model"]["kind"] == "gpt":
        raw["model"].pop("path")
    with pytest.raises(ConfigError, match=says):
        prepare(load(write_config(tmp / "c.toml", raw)), None)


@pytest.mark.slow
def test_a_run_at_tp2_sp_with_microbatches_is_the_one_process_run(hf_run):
    from tests.trainer_runs import rows, train
    tmp, raw = hf_run
    raw["run"]["steps"] = 3
    raw["layout"] = {"tp": 2, "sequence_parallel": True, "microbatches": 2}
    raw["log"] = {"plot": False, "tensorboard": False}
    r = train(write_config(tmp / "tp2.toml", raw), 2)
    assert r.returncode == 0, r.stdout
    raw["run"]["out"], raw["layout"] = str(tmp / "one"), {}
    r = train(write_config(tmp / "one.toml", raw), 1)
    assert r.returncode == 0, r.stdout
    got, want = rows(tmp / "out"), rows(tmp / "one")
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert abs(float(g["loss"]) - float(w["loss"])) <= 1e-5 * abs(float(w["loss"])), (g, w)
    assert abs(float(got[-1]["val_loss"]) - float(want[-1]["val_loss"])) <= 1e-5 * float(want[-1]["val_loss"])
