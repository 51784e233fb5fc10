"""The trainer's data: token files, text tokenization and its cache, the batch sampler."""
import json
import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxmegatron.errors import DataError
from fxmegatron.train import documents, tokens
from fxmegatron.train.data import (Batches, TokenStream, eval_windows, memmap_tokens, split_stream,
                                   text_tokens, tokenizer_vocab_size)
from fxmegatron.train.token_files import write_tokens


def _bin(path, values, dtype):
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


def _arange_stream(n_tokens):
    return TokenStream(np.arange(n_tokens, dtype=np.int64), name="arange")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny word-level tokenizer with an EOS, built offline and saved like a hub one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["the cat sat on the mat", "a dog ran far"],
                           trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>").save_pretrained(d)
    return str(d)


def _hf(hf_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)


# --- token files --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,top", [("uint16", 65535), ("uint32", 70000)])
def test_memmap_round_trip(tmp_path, dtype, top):
    values = np.array([0, 5, top, 7, 1], dtype=np.int64)
    s = memmap_tokens(_bin(tmp_path / "t.bin", values, dtype), dtype)
    assert len(s) == 5
    got = s.read(1, 3)
    assert got.dtype == np.int64 and got.tolist() == [5, top, 7]
    got[0] = -1                      # a copy: the read-only map is untouched
    assert s.read(0, 5).tolist() == values.tolist()
    assert s.vocab_needed == top + 1


def test_memmap_errors(tmp_path):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(DataError, match="nope.bin: token file not found"):
        memmap_tokens(missing, "uint16")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 7)
    with pytest.raises(DataError, match=r"odd.bin: size 7 bytes is not a multiple of 2"):
        memmap_tokens(str(odd), "uint16")
    six = tmp_path / "six.bin"
    six.write_bytes(b"\0" * 6)
    with pytest.raises(DataError, match=r"six.bin: size 6 bytes is not a multiple of 4"):
        memmap_tokens(str(six), "uint32")
    for bad in ("int32", "uint8", "float32"):
        with pytest.raises(DataError, match=rf"six.bin: token dtype must be one of .*{bad}"):
            memmap_tokens(str(six), bad)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty.bin: token file is empty"):
        memmap_tokens(str(empty), "uint16")


def test_written_tokens_record_their_dtype(tmp_path):
    path = str(tmp_path / "t.bin")
    assert write_tokens(path, [[3, 70000], np.array([5, 1])], "uint32", {"note": "x"}) == 4
    side = json.loads(open(path + ".json").read())
    assert (side["dtype"], side["tokens"], side["note"]) == ("uint32", 4, "x")
    s = memmap_tokens(path, "uint32")
    assert s.read(0, 4).tolist() == [3, 70000, 5, 1] and s.dtype_hint == ""
    with pytest.raises(DataError, match=rf'^{path}: {path}.json records uint32 tokens, but they are to be read as '
                                        r'uint16: set data.token_dtype = "uint32"$'):
        memmap_tokens(path, "uint16")
    with open(path, "ab") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(DataError, match=rf"^{path}: 20 bytes, but {path}.json records 4 uint32 tokens .*truncated or "
                                        "replaced"):
        memmap_tokens(path, "uint32")
    with pytest.raises(DataError, match="token id 70000 does not fit uint16"):
        write_tokens(str(tmp_path / "u.bin"), [[70000]], "uint16")
    # the sidecar vouches for a file that would look like the other dtype without it
    odd = str(tmp_path / "odd.bin")
    write_tokens(odd, [np.array([[i % 300, 0] for i in range(500)]).ravel()], "uint16")
    assert len(memmap_tokens(odd, "uint16")) == 1000


@pytest.mark.parametrize("ids", [np.arange(1000) % 300, 60000 + np.arange(1000) * 10],
                         ids=["ids-below-65536", "llama3-sized-ids"])
def test_uint32_file_read_as_uint16_is_refused(tmp_path, ids):
    path = _bin(tmp_path / "t.bin", ids, np.uint32)
    with pytest.raises(DataError, match=rf'^{path}: read as uint16, every second id .* the upper halves of uint32 ids; '
                                        r'set data.token_dtype = "uint32"; if it really is uint16, write '):
        memmap_tokens(path, "uint16")
    assert memmap_tokens(path, "uint32").read(0, 3).tolist() == ids[:3].tolist()


def test_uint16_file_read_as_uint32_is_refused(tmp_path):
    ids = np.random.default_rng(0).integers(0, 1000, 1000)
    even = _bin(tmp_path / "even.bin", ids, np.uint16)
    with pytest.raises(DataError, match=rf'^{even}: read as uint32 it holds id \d+, beyond any vocabulary: pairs of '
                                        r'uint16 ids; set data.token_dtype = "uint16"'):
        memmap_tokens(even, "uint32")
    odd = _bin(tmp_path / "odd.bin", ids[:999], np.uint16)
    with pytest.raises(DataError, match=rf'^{odd}: size 1998 bytes is not a multiple of 4 .*: a uint16 file\? set '
                                        r'data.token_dtype = "uint16"'):
        memmap_tokens(odd, "uint32")
    assert "if the file holds uint32 ids" in memmap_tokens(even, "uint16").dtype_hint


def test_read_outside_stream(tmp_path):
    s = memmap_tokens(_bin(tmp_path / "t.bin", range(10), "uint16"), "uint16")
    assert s.read(7, 3).tolist() == [7, 8, 9]
    with pytest.raises(DataError, match=r"t.bin: read of \[8, 11\) outside its 10 tokens"):
        s.read(8, 3)


# --- text ---------------------------------------------------------------------------------

def test_byte_text(tmp_path):
    a, b, e = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "e.txt"
    a.write_text("héllo\n", encoding="utf-8")
    e.write_text("")
    b.write_text("wörld", encoding="utf-8")
    s = text_tokens([str(a), str(e), str(b)], "bytes")
    raw = "héllo\n".encode() + "wörld".encode()
    assert len(s) == len(raw)
    assert s.read(0, len(s)).tolist() == list(raw)
    assert s.read(4, 6).tolist() == list(raw[4:10])      # a read across the two files
    assert s.vocab_needed == max(raw) + 1
    assert tokenizer_vocab_size("bytes") == 256
    with pytest.raises(DataError, match="missing.txt: text file not found"):
        text_tokens([str(a), str(tmp_path / "missing.txt")], "bytes")


def test_the_docs_say_what_bytes_do_between_files():
    """Bytes put nothing between files (test_byte_text: 256 byte values leave no id for an EOS);
    docs/TRAINER.md once said every text file was followed by an EOS."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "TRAINER.md")).read()
    data = " ".join(doc.split("- **Data.**")[1].split("- **Evaluation.**")[0].split())
    assert 'tokenized by bytes (`data.tokenizer = "bytes"`: the files\' bytes joined as they are, with no ' \
           "separator between files" in data, data
    assert "(each file a document, the tokenizer's EOS after it when it has one;" in data, data


def test_hf_tokenizer_appends_eos_per_document(tmp_path, hf_dir):
    tok = _hf(hf_dir)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the cat sat")
    b.write_text("a dog ran on the mat")
    eos = tok.eos_token_id
    want = (tok.encode("the cat sat", add_special_tokens=False) + [eos]
            + tok.encode("a dog ran on the mat", add_special_tokens=False) + [eos])
    s = text_tokens([str(a), str(b)], hf_dir)
    assert s.read(0, len(s)).tolist() == want
    assert want.count(eos) == 2 and want[3] == eos
    assert tokenizer_vocab_size(hf_dir) == len(tok)
    assert s.vocab_needed <= len(tok)
    with pytest.raises(DataError, match="no_tok: tokenizer must be 'bytes' or a directory"):
        text_tokens([str(a)], str(tmp_path / "no_tok"))


def _counting(monkeypatch):
    calls = []
    real = documents._tokenize_file

    def counted(tok, path, texts):
        calls.append(path)
        return real(tok, path, texts)
    monkeypatch.setattr(documents, "_tokenize_file", counted)
    return calls


def test_hf_cache_is_written_once_and_reused(tmp_path, hf_dir, monkeypatch):
    calls = _counting(monkeypatch)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("the cat sat")
    b.write_text("a dog ran")
    cache = tmp_path / "cache"
    first = text_tokens([str(a), str(b)], hf_dir, cache_dir=str(cache))
    assert len(calls) == 2
    bins = sorted(p for p in os.listdir(cache) if p.endswith(".bin"))
    assert len(bins) == 1 and not [p for p in os.listdir(cache) if ".tmp-" in p]
    meta = json.loads((cache / (bins[0] + ".json")).read_text())      # token_files' sidecar
    assert meta["dtype"] == "uint16" and meta["tokens"] == len(first)
    second = text_tokens([str(a), str(b)], hf_dir, cache_dir=str(cache))
    assert len(calls) == 2                                  # memmapped, not tokenized again
    assert second.read(0, len(second)).tolist() == first.read(0, len(first)).tolist()
    assert second.read(0, len(second)).tolist() == text_tokens([str(a), str(b)], hf_dir).read(0, len(first)).tolist()
    b.write_text("a dog ran far far")                       # an edited file gets a new key
    third = text_tokens([str(a), str(b)], hf_dir, cache_dir=str(cache))
    assert len(calls) == 6 and len(third) == len(first) + 2
    not_a_dir = tmp_path / "plain_file"
    not_a_dir.write_text("")
    with pytest.raises(DataError, match="plain_file: cannot read or write the token cache"):
        text_tokens([str(a)], hf_dir, cache_dir=str(not_a_dir))


def test_hf_cache_ignores_a_partial_write(tmp_path, hf_dir, monkeypatch):
    a = tmp_path / "a.txt"
    a.write_text("the cat sat")
    cache = tmp_path / "cache"
    cache.mkdir()
    key = documents.cache_key([str(a)], hf_dir)
    (cache / f"{key}.bin").write_bytes(b"\1\0")              # a dead writer's .bin, without .json
    s = text_tokens([str(a)], hf_dir, cache_dir=str(cache))
    assert s.read(0, len(s)).tolist() == text_tokens([str(a)], hf_dir).read(0, len(s)).tolist()
    assert len(s) == 4


def test_hf_cache_concurrent_callers_tokenize_once(tmp_path, hf_dir, monkeypatch):
    calls = _counting(monkeypatch)
    a = tmp_path / "a.txt"
    a.write_text("the cat sat on the mat " * 50)
    cache, out, errors = str(tmp_path / "cache"), [], []
    start = threading.Barrier(4)

    def rank():
        try:
            start.wait()
            s = text_tokens([str(a)], hf_dir, cache_dir=cache)
            out.append(s.read(0, len(s)).tolist())
        except Exception as e:   # noqa: BLE001  (reported below, in the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(calls) == 1 and len(out) == 4 and all(o == out[0] for o in out)


# --- streams ------------------------------------------------------------------------------

def test_split_has_no_overlap(tmp_path):
    s = memmap_tokens(_bin(tmp_path / "t.bin", np.arange(1000) % 300, "uint16"), "uint16")
    train, valid = split_stream(s, 0.1)
    assert (len(train), len(valid)) == (900, 100)
    assert np.array_equal(np.concatenate([train.read(0, 900), valid.read(0, 100)]), s.read(0, 1000))
    assert valid.read(0, 3).tolist() == [0, 1, 2]            # tokens 900.. of the file
    assert train.vocab_needed == 300 and valid.vocab_needed == 100
    assert "t.bin" in valid.name
    with pytest.raises(DataError, match=r"t.bin\[900:\] \(valid\): read of \[99, 101\) outside its 100 tokens"):
        valid.read(99, 2)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(DataError, match="t.bin: valid_fraction must be in"):
            split_stream(s, bad)


def test_vocab_needed_scans_in_chunks_and_caches(monkeypatch):
    monkeypatch.setattr(tokens, "_SCAN_CHUNK", 3)
    parts = [np.array([1, 2], np.uint16), np.array([4, 9, 3, 0, 2], np.uint16), np.array([5], np.uint16)]
    s = TokenStream(parts, name="parts")
    reads = []
    real = TokenStream.read
    monkeypatch.setattr(TokenStream, "read", lambda self, a, n: reads.append((a, n)) or real(self, a, n))
    assert s.vocab_needed == 10
    assert reads == [(0, 3), (3, 3), (6, 2)]
    assert s.vocab_needed == 10 and len(reads) == 3


# --- the sampler --------------------------------------------------------------------------

def test_windows_are_packed_chunks(tmp_path):
    s = memmap_tokens(_bin(tmp_path / "t.bin", range(40), "uint16"), "uint16")
    b = Batches(s, seq_len=8, global_batch=2, seed=0)
    assert b.n == 4                                         # (40 - 1) // 8: the last window lacks a label
    w = b.windows(0)
    assert w.dtype == torch.int64 and w.shape == (2, 9)
    for row, i in zip(w, b.indices(0)):
        assert row.tolist() == list(range(8 * i, 8 * i + 9))
    with pytest.raises(DataError, match=r"t.bin: 40 tokens make 4 windows .* fewer than global_batch = 5"):
        Batches(s, seq_len=8, global_batch=5, seed=0)


def test_batches_depend_only_on_seed_and_step():
    s = _arange_stream(1000)
    a, b = Batches(s, 7, 5, seed=3), Batches(s, 7, 5, seed=3)
    steps = list(range(40))
    want = {k: a.windows(k) for k in steps}
    rng = np.random.default_rng(0)
    for k in rng.permutation(steps):                        # another order, a fresh cache
        assert torch.equal(b.windows(int(k)), want[int(k)])
    assert torch.equal(Batches(s, 7, 5, seed=3).windows(39), want[39])   # straight to a late step
    assert not torch.equal(Batches(s, 7, 5, seed=4).windows(0), want[0])


def test_indices_follow_the_documented_recipe():
    n, gb, seed = 10, 4, 11
    b = Batches(_arange_stream(n * 3 + 1), 3, gb, seed)
    order = np.concatenate([np.random.Generator(np.random.PCG64([seed, e])).permutation(n) for e in range(3)])
    for k in range(7):
        assert b.indices(k).tolist() == order[k * gb:(k + 1) * gb].tolist()


def test_epoch_rollover_covers_each_window_once():
    n, gb = 10, 4
    b = Batches(_arange_stream(n * 2 + 1), 2, gb, seed=0)
    drawn = np.concatenate([b.indices(k) for k in range(5)])   # 20 positions: epochs 0 and 1
    assert b.epoch_of(2) == 0 and b.epoch_of(3) == 1            # step 2 straddles the boundary
    for e in range(2):
        assert sorted(drawn[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert drawn[:n].tolist() != drawn[n:].tolist()             # a new order each epoch


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_every_epoch_is_a_permutation(n, data):
    gb = data.draw(st.integers(1, n), label="global_batch")
    epochs = data.draw(st.integers(1, 3), label="epochs")
    seed = data.draw(st.integers(0, 2**32), label="seed")
    seq = data.draw(st.integers(1, 4), label="seq_len")
    b = Batches(_arange_stream(n * seq + 1), seq, gb, seed)
    steps = -(-epochs * n // gb)
    drawn = np.concatenate([b.indices(k) for k in range(steps)])
    for e in range(epochs):
        assert sorted(drawn[e * n:(e + 1) * n].tolist()) == list(range(n))
    fresh = Batches(_arange_stream(n * seq + 1), seq, gb, seed)
    last = steps - 1
    assert fresh.indices(last).tolist() == drawn[last * gb:(last + 1) * gb].tolist()
    assert torch.equal(fresh.windows(last)[:, 0], torch.from_numpy(fresh.indices(last) * seq))


def test_state_check(tmp_path):
    vals = np.arange(9000) % 500
    s = memmap_tokens(_bin(tmp_path / "t.bin", vals, "uint16"), "uint16")
    saved = json.loads(json.dumps(Batches(s, 16, 4, seed=1).state()))   # as a checkpoint stores it
    Batches(s, 16, 4, seed=1).check_state(saved)
    moved = memmap_tokens(_bin(tmp_path / "copy.bin", vals, "uint32"), "uint32")
    Batches(moved, 16, 4, seed=1).check_state(saved)         # same tokens elsewhere, other dtype
    with pytest.raises(DataError, match=r"t.bin: .*seed was 1, is 2"):
        Batches(s, 16, 4, seed=2).check_state(saved)
    with pytest.raises(DataError, match=r"seq_len was 16, is 32; global_batch was 4, is 2; n_windows"):
        Batches(s, 32, 2, seed=1).check_state(saved)
    edited = vals.copy()
    edited[-1] += 1
    other = memmap_tokens(_bin(tmp_path / "edited.bin", edited, "uint16"), "uint16")
    with pytest.raises(DataError, match=r"edited.bin: .*\(saved from .*t.bin\): stream content differs"):
        Batches(other, 16, 4, seed=1).check_state(saved)
    shorter = memmap_tokens(_bin(tmp_path / "short.bin", vals[:-1], "uint16"), "uint16")
    with pytest.raises(DataError, match=r"stream length was 9000 tokens, is 8999"):
        Batches(shorter, 16, 4, seed=1).check_state(saved)
    with pytest.raises(DataError, match=r"lacks \['seed'\]"):
        Batches(s, 16, 4, seed=1).check_state({k: v for k, v in saved.items() if k != "seed"})


def test_eval_windows(tmp_path):
    s = memmap_tokens(_bin(tmp_path / "v.bin", range(50), "uint16"), "uint16")
    ev = eval_windows(s, 4, 3, batches=2)                   # 12 windows, the first 6 in order
    assert len(ev) == 2 and ev[0].shape == (3, 5)
    assert [row[0].item() for w in ev for row in w] == [0, 4, 8, 12, 16, 20]
    assert ev[1][2].tolist() == [20, 21, 22, 23, 24]
    with pytest.warns(UserWarning, match="v.bin: 12 windows hold 4 eval batches"):
        assert len(eval_windows(s, 4, 3, batches=9)) == 4
    with pytest.raises(DataError, match=r"v.bin: 50 tokens make 1 windows"):
        eval_windows(s, 40, 3, batches=1)
