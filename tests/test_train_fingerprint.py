"""The data fingerprint a checkpoint records: an edit of one token anywhere in the corpus is refused
on resume, naming the file; an unchanged corpus resumes, its content hash read from the run's cache
(a stat of each file, not a read); a checkpoint written before the content hash still resumes, with a
warning that says what it cannot check."""
import os
import warnings

import numpy as np
import pytest

from fxmegatron.errors import DataError
from fxmegatron.train.data import Batches, TokenStream, memmap_tokens, text_tokens
from fxmegatron.train.token_files import write_tokens
from tests.trainer_runs import TINY, train, write_config


def _bin(path, values, dtype="uint16", age_s=0):
    write_tokens(str(path), [np.asarray(values)], dtype)
    if age_s:       # written long ago: its digest may be cached (a file modified just now may not)
        t = os.stat(path).st_mtime - age_s
        os.utime(path, (t, t))
    return str(path)


def _edit_middle(path, dtype="<u2"):
    arr = np.memmap(path, dtype=dtype, mode="r+")
    arr[len(arr) // 2] += 1
    arr.flush()
    del arr


def test_one_token_edited_in_the_middle_is_refused(tmp_path):
    vals = np.arange(100_000) % 500                  # far more than the first and last 4096 tokens
    path = _bin(tmp_path / "t.bin", vals)
    saved = Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).state()
    _edit_middle(path)
    with pytest.raises(DataError, match=r"t.bin: resumed data does not match the checkpoint's: stream content "
                                        r"differs \(hash of every token\)"):
        Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).check_state(saved)


def test_the_cached_digest_is_used_while_the_file_is_unchanged_and_not_after_an_edit(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    path = _bin(tmp_path / "t.bin", np.arange(50_000) % 300, age_s=3600)
    saved = Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).state(cache)
    real = TokenStream._content_sha256
    monkeypatch.setattr(TokenStream, "_content_sha256", lambda self: pytest.fail("read the corpus again"))
    Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).check_state(saved, cache)   # a stat, no read
    monkeypatch.setattr(TokenStream, "_content_sha256", real)
    _edit_middle(path)
    with pytest.raises(DataError, match=r"t.bin: .*stream content differs \(hash of every token\)"):
        Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).check_state(saved, cache)


def test_a_file_modified_just_now_is_not_cached(tmp_path):
    """Linux stamps a file with a coarse clock: an edit in the same tick as the hash keeps mtime."""
    cache = tmp_path / "cache"
    TokenStream(np.zeros(3, np.uint16)).fingerprint(str(cache))     # in memory: nothing to cache
    memmap_tokens(_bin(tmp_path / "new.bin", np.arange(100)), "uint16").fingerprint(str(cache))
    assert not [f for f in os.listdir(cache) if f.endswith(".json")]
    memmap_tokens(_bin(tmp_path / "old.bin", np.arange(100), age_s=60), "uint16").fingerprint(str(cache))
    assert len([f for f in os.listdir(cache) if f.endswith(".json")]) == 1


def test_the_content_hash_does_not_depend_on_the_dtype_or_the_split(tmp_path):
    vals = np.arange(20_000) % 700
    a = memmap_tokens(_bin(tmp_path / "a.bin", vals, "uint16"), "uint16").fingerprint()
    b = memmap_tokens(_bin(tmp_path / "b.bin", vals, "uint32"), "uint32").fingerprint(str(tmp_path / "c"))
    assert a == b == TokenStream(vals.astype(np.int64)).fingerprint()
    s = TokenStream(vals)
    assert s.view(0, 10_000).fingerprint() != s.view(0, 10_001).fingerprint()


def test_a_checkpoint_without_a_content_hash_resumes_with_a_warning(tmp_path):
    path = _bin(tmp_path / "t.bin", np.arange(9000) % 500)
    saved = Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).state()
    del saved["stream"]["content_sha256"]            # as fxmegatron wrote it before
    with pytest.warns(UserWarning, match=r"t.bin: the checkpoint's data fingerprint predates content_sha256"):
        Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).check_state(saved)
    saved["stream"]["sha256"] = "0" * 64
    with pytest.raises(DataError, match=r"first and last 4096 tokens"):
        Batches(memmap_tokens(path, "uint16"), 16, 4, seed=1).check_state(saved)


@pytest.mark.slow
def test_resume_on_a_corpus_edited_in_the_middle_is_one_line_naming_the_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    text = open(TINY, "rb").read()
    corpus.write_bytes(text)
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(out), "steps": 2},
        "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"train": str(corpus), "seq_len": 16, "global_batch": 4},
        "log": {"plot": False, "tensorboard": False},
    })
    assert train(cfg, 1).returncode == 0
    r = train(cfg, 1, "--set", "run.steps=3")          # unchanged: resumes
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout
    mid = len(text) // 2
    corpus.write_bytes(text[:mid] + bytes([text[mid] ^ 1]) + text[mid + 1:])
    r = train(cfg, 1, "--set", "run.steps=4")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("fxmegatron:")]
    assert r.returncode != 0 and len(lines) == 1, r.stdout
    assert f"{corpus}" in lines[0] and "stream content differs (hash of every token)" in lines[0], lines[0]
