"""``data.kind = "jsonl"``: each record's text field is a document. Checked against hand-computed
token streams (bytes and an HF tokenizer with an EOS), the text kind over the same documents,
the cache, the errors that name a file and line, and the trainer's batches."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fxmegatron.errors import DataError
from fxmegatron.train import documents
from fxmegatron.train.documents import jsonl_tokens, text_tokens
from tests.test_train_data import hf_dir  # noqa: F401  (the fixture: a word-level tokenizer with an EOS)
from tests.trainer_runs import TINY, write_config

DOCS = ["the cat sat", "on the mat", "a dog ran far"]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_bytes_are_the_records_text_joined(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"text": t, "id": i} for i, t in enumerate(DOCS)] + [{"text": "é"}])
    s = jsonl_tokens([p], "bytes")
    assert s.read(0, len(s)).tolist() == list("".join(DOCS + ["é"]).encode("utf-8"))


def test_an_hf_tokenizer_puts_its_eos_after_every_record(tmp_path, hf_dir):  # noqa: F811
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    eos = tok.eos_token_id
    p = _jsonl(tmp_path / "d.jsonl", [{"body": t} for t in DOCS])
    want = [i for t in DOCS for i in tok.encode(t, add_special_tokens=False) + [eos]]
    s = jsonl_tokens([p], hf_dir, field="body")
    assert s.read(0, len(s)).tolist() == want and want.count(eos) == 3
    # the same documents as text files, one per file: the same stream
    files = []
    for i, t in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(t)
        files.append(str(tmp_path / f"{i}.txt"))
    t = text_tokens(files, hf_dir)
    assert t.read(0, len(t)).tolist() == want


def test_the_cache_is_keyed_by_the_field(tmp_path, hf_dir, monkeypatch):  # noqa: F811
    p = _jsonl(tmp_path / "d.jsonl", [{"a": t, "b": t.upper()} for t in DOCS])
    cache = str(tmp_path / "cache")
    calls = []
    real = documents._tokenize_file
    monkeypatch.setattr(documents, "_tokenize_file", lambda tok, path, texts: calls.append(path) or real(tok, path, texts))
    a1 = jsonl_tokens([p], hf_dir, "a", cache_dir=cache)
    a2 = jsonl_tokens([p], hf_dir, "a", cache_dir=cache)
    b = jsonl_tokens([p], hf_dir, "b", cache_dir=cache)
    assert len(calls) == 2                          # a once, b once
    assert a1.read(0, len(a1)).tolist() == a2.read(0, len(a2)).tolist() == jsonl_tokens([p], hf_dir, "a").read(0, len(a1)).tolist()
    assert b.read(0, len(b)).tolist() != a1.read(0, len(a1)).tolist()
    assert documents.cache_key([p], hf_dir, "a") != documents.cache_key([p], hf_dir, "b") != documents.cache_key([p], hf_dir)


@pytest.mark.parametrize("lines,match", [
    (['{"text": "ok"}', '{"text": "ok"'], r"d.jsonl:2: not a JSON record"),
    (['{"text": "ok"}', '', '{"txt": "no"}'], r"d.jsonl:3: the record has no string field 'text' \(data.text_field\); it has \['txt'\]"),
    (['{"text": 3}'], r"d.jsonl:1: the record has no string field 'text'"),
    (['["text"]'], r"d.jsonl:1: the record has no string field 'text' \(data.text_field\); it has list"),
])
def test_a_bad_line_is_named(tmp_path, lines, match):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=match):
        jsonl_tokens([str(p)], "bytes")


def test_the_trainer_draws_the_text_kinds_batches_from_the_same_bytes(tmp_path):
    """TINY cut into records: by bytes, the jsonl stream is TINY's bytes, so every batch is."""
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    text = open(TINY, encoding="utf-8").read()
    cuts = sorted({0, len(text)} | set(np.random.default_rng(0).integers(1, len(text), 40).tolist()))
    p = _jsonl(tmp_path / "tiny.jsonl", [{"text": text[a:b]} for a, b in zip(cuts, cuts[1:])])
    base = {"run": {"out": str(tmp_path / "out"), "steps": 2},
            "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
            "data": {"train": TINY, "seq_len": 16, "global_batch": 4}}
    as_text = prepare(load(write_config(tmp_path / "t.toml", base)), 1)
    base["data"].update(kind="jsonl", train=p)
    as_jsonl = prepare(load(write_config(tmp_path / "j.toml", base)), 1)
    assert as_jsonl.vocab_data == as_text.vocab_data == 256
    for step in range(3):
        assert as_jsonl.train.windows(step).tolist() == as_text.train.windows(step).tolist()
    assert [w.tolist() for w in as_jsonl.valid] == [w.tolist() for w in as_text.valid]
