"""``data.kind = "parquet"`` and ``"hf_dataset"``: each row's text column is a document, tokenized
and cached as JSON Lines records are. Checked against hand-computed token streams (bytes and an
HF tokenizer with an EOS), the jsonl stream of the same records, the errors that name the file
and row, and a short trainer run whose losses equal the jsonl run's."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from fxmegatron.errors import ConfigError, DataError  # noqa: E402
from fxmegatron.train import documents  # noqa: E402
from fxmegatron.train.documents import jsonl_tokens, record_tokens  # noqa: E402
from tests.test_train_data import hf_dir  # noqa: F401,E402  (the fixture: a word-level tokenizer with an EOS)
from tests.trainer_runs import TINY, rows, train, write_config  # noqa: E402

DOCS = ["the cat sat", "on the mat", "a dog ran far", "é"]


def _parquet(path, texts, row_group_size=2, **extra):
    pq.write_table(pa.table({"text": list(texts), **extra}), str(path), row_group_size=row_group_size)
    return str(path)


def _dataset(path, texts, **extra):
    datasets.Dataset.from_dict({"text": list(texts), **extra}).save_to_disk(str(path))
    return str(path)


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def _write(path, text):
    path.write_text(text)
    return str(path)


def _all(s):
    return s.read(0, len(s)).tolist()


def test_bytes_are_the_rows_text_joined_in_file_and_row_order(tmp_path):
    a = _parquet(tmp_path / "a.parquet", DOCS[:3], n=[1, 2, 3])     # two row groups
    b = _parquet(tmp_path / "b.parquet", DOCS[3:])
    want = list("".join(DOCS).encode("utf-8"))
    assert pq.ParquetFile(a).num_row_groups == 2
    assert _all(record_tokens("parquet", [a, b], "bytes")) == want
    d1, d2 = _dataset(tmp_path / "d1", DOCS[:3]), _dataset(tmp_path / "d2", DOCS[3:])
    assert _all(record_tokens("hf_dataset", [d1, d2], "bytes")) == want
    assert _all(jsonl_tokens([_jsonl(tmp_path / "a.jsonl", DOCS)], "bytes")) == want


def test_an_hf_tokenizer_puts_its_eos_after_every_row_and_caches_per_kind(tmp_path, hf_dir):  # noqa: F811
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    want = [i for t in DOCS for i in tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]]
    p = _parquet(tmp_path / "d.parquet", DOCS)
    d = _dataset(tmp_path / "ds", DOCS)
    j = _jsonl(tmp_path / "d.jsonl", DOCS)
    cache = str(tmp_path / "cache")
    assert _all(jsonl_tokens([j], hf_dir)) == want and want.count(tok.eos_token_id) == 4
    for kind, path in (("parquet", p), ("hf_dataset", d)):
        assert _all(record_tokens(kind, [path], hf_dir)) == want
        assert _all(record_tokens(kind, [path], hf_dir, cache_dir=cache)) == want     # written
        assert _all(record_tokens(kind, [path], hf_dir, cache_dir=cache)) == want     # read back
    assert len([f for f in os.listdir(cache) if f.endswith(".bin")]) == 2
    assert documents.cache_key([p], hf_dir, "text", "parquet") != documents.cache_key([p], hf_dir, "text", "jsonl")


def test_the_jsonl_cache_key_is_unchanged(tmp_path, hf_dir):  # noqa: F811
    """What the key hashed before parquet and hf_dataset: existing caches stay valid."""
    j = _jsonl(tmp_path / "d.jsonl", DOCS)
    st = os.stat(j)
    desc = {"format": 2, "files": [[os.path.abspath(j), st.st_size, st.st_mtime_ns]],
            "tokenizer": documents._dir_sha256(hf_dir), "jsonl_field": "text"}
    want = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()
    assert documents.cache_key([j], hf_dir, "text") == want


def test_a_rewritten_dataset_folder_gets_a_new_cache_key(tmp_path, hf_dir):  # noqa: F811
    d = _dataset(tmp_path / "ds", DOCS)
    before = documents.cache_key([d], hf_dir, "text", "hf_dataset")
    arrow = [f for f in os.listdir(d) if f.endswith(".arrow")][0]
    os.utime(os.path.join(d, arrow), ns=(1, 1))      # a file inside changed; the folder's own mtime did not
    assert documents.cache_key([d], hf_dir, "text", "hf_dataset") != before


@pytest.mark.parametrize("make,kind,match", [
    (lambda t: _parquet(t / "d.parquet", DOCS), "parquet",
     r"d\.parquet: no column 'body' \(data.text_field\); it has \['text'\]"),
    (lambda t: _parquet(t / "d.parquet", ["x", "y", "z"], body=["ok", "ok", None]), "parquet",
     r"d\.parquet: row 2 \(counting from 0\): 'body' \(data.text_field\) is None, not a string"),
    (lambda t: _parquet(t / "d.parquet", ["x"], body=[7]), "parquet",
     r"d\.parquet: row 0 \(counting from 0\): 'body' \(data.text_field\) is 7, not a string \(column type int64\)"),
    (lambda t: _write(t / "d.parquet", "not parquet"), "parquet",
     r"d\.parquet: not a readable Parquet file"),
    (lambda t: _dataset(t / "ds", DOCS), "hf_dataset", r"ds: no column 'body' \(data.text_field\); it has \['text'\]"),
    (lambda t: _dataset(t / "ds", ["x", "y"], body=["ok", None]), "hf_dataset",
     r"ds: row 1 \(counting from 0\): 'body' \(data.text_field\) is None, not a string"),
    (lambda t: (t / "ds").mkdir() or str(t / "ds"), "hf_dataset",
     r"ds: not a folder written by datasets' save_to_disk"),
    (lambda t: str(t / "missing"), "hf_dataset", r"missing: no such folder \(data.kind = 'hf_dataset'"),
])
def test_bad_input_is_named(tmp_path, make, kind, match):
    path = make(tmp_path)
    with pytest.raises(DataError, match=match):
        record_tokens(kind, [path], "bytes", field="body")


def test_a_dataset_dict_is_refused_but_its_split_folder_is_read(tmp_path):
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS}),
                          "validation": datasets.Dataset.from_dict({"text": DOCS[:1]})}).save_to_disk(str(dd))
    with pytest.raises(DataError, match=r"dd: a DatasetDict of splits \['train', 'validation'\]: give the folder of "
                                        r"one split, e.g. .*dd/train"):
        record_tokens("hf_dataset", [str(dd)], "bytes")
    assert _all(record_tokens("hf_dataset", [str(dd / "validation")], "bytes")) == list(DOCS[0].encode())


@pytest.mark.parametrize("module,kind", [("pyarrow.parquet", "parquet"), ("datasets", "hf_dataset")])
def test_a_missing_package_says_how_to_install_it(tmp_path, monkeypatch, module, kind):
    path = _parquet(tmp_path / "d.parquet", DOCS) if kind == "parquet" else _dataset(tmp_path / "ds", DOCS)
    monkeypatch.setitem(sys.modules, module, None)      # import raises ImportError
    with pytest.raises(DataError, match=rf"data.kind = '{kind}' needs the {module.split('.')[0]} package .*"
                                        r"pip install 'fxmegatron\[data\]'"):
        record_tokens(kind, [path], "bytes")


def test_the_config_takes_folders_for_hf_dataset(tmp_path):
    from fxmegatron.train.config import load
    from fxmegatron.train.config_checks import check_files
    base = {"run": {"out": str(tmp_path / "out"), "steps": 1}, "data": {"kind": "hf_dataset", "train": "nope",
                                                                        "seq_len": 8, "global_batch": 2}}
    with pytest.raises(ConfigError, match=r"data folder .*nope does not exist \(data.kind = 'hf_dataset'"):
        check_files(load(write_config(tmp_path / "c.toml", base)))
    base["data"]["train"] = _dataset(tmp_path / "ds", DOCS)
    check_files(load(write_config(tmp_path / "c.toml", base)))


@pytest.mark.slow
def test_a_parquet_run_has_the_losses_of_the_jsonl_run(tmp_path):
    """TINY cut into records, as parquet and as jsonl: by bytes the same stream, so the same losses."""
    text = open(TINY, encoding="utf-8").read()
    cuts = list(range(0, len(text), 97)) + [len(text)]
    texts = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    losses = {}
    for kind, path in (("jsonl", _jsonl(tmp_path / "t.jsonl", texts)),
                       ("parquet", _parquet(tmp_path / "t.parquet", texts, row_group_size=7))):
        out = tmp_path / kind
        cfg = write_config(tmp_path / f"{kind}.toml", {
            "run": {"out": str(out), "steps": 3, "seed": 1, "log_every": 1},
            "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
            "data": {"kind": kind, "train": path, "seq_len": 16, "global_batch": 4},
            "eval": {"batches": 1}, "log": {"plot": False, "tensorboard": False}})
        r = train(cfg, 1)
        assert r.returncode == 0, r.stdout
        losses[kind] = [(x["loss"], x["val_loss"]) for x in rows(out)]
    assert len(losses["parquet"]) == 3 and losses["parquet"] == losses["jsonl"]
