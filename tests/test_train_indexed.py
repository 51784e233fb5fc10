"""``data.kind = "indexed"``: Megatron's PREFIX.bin + PREFIX.idx. The files are written here
byte by byte after Megatron-core's ``_IndexWriter`` (not by fxmegatron), and the stream read
back must be every sequence's ids in order; the errors name the file; the trainer draws the
same batches as from the same ids in a flat ``.bin`` (``data.kind = "tokens"``)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from fxmegatron.errors import DataError
from fxmegatron.train.indexed import indexed_tokens, read_index
from tests.trainer_runs import write_config

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def write_megatron(prefix, documents, dtype=np.uint16, modes=False, pointers=None, version=1, magic=b"MMIDIDX\x00\x00"):
    """PREFIX.bin and PREFIX.idx for ``documents`` (each a list of sequences, each a list of ids),
    laid out as Megatron-core's IndexedDatasetBuilder writes them."""
    seqs = [s for doc in documents for s in doc]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    lengths = [len(s) for s in seqs]
    size = np.dtype(dtype).itemsize
    if pointers is None:
        pointers = [size * sum(lengths[:i]) for i in range(len(lengths))]
    doc_idx = [0]
    for doc in documents:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(magic)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.array(lengths, dtype=np.int32).tobytes())
        f.write(np.array(pointers, dtype=np.int64).tobytes())
        f.write(np.array(doc_idx, dtype=np.int64).tobytes())
        if modes:
            f.write(np.zeros(len(seqs), dtype=np.int8).tobytes())
    return str(prefix)


DOCS = [[[5, 6, 7, 0]], [[8, 9], [10, 11, 0]], [[12, 0]]]     # three documents, the second of two sequences
IDS = [5, 6, 7, 0, 8, 9, 10, 11, 0, 12, 0]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_the_stream_is_every_sequence_in_order(tmp_path, dtype):
    prefix = write_megatron(tmp_path / "corpus_text_document", DOCS, dtype)
    for path in (prefix, prefix + ".bin", prefix + ".idx"):
        s = indexed_tokens([path])
        assert s.read(0, len(s)).tolist() == IDS
    index = read_index(prefix)
    assert index.lengths.tolist() == [4, 2, 3, 2] and index.documents.tolist() == [0, 1, 3, 4]
    assert index.tokens == len(IDS) and index.dtype.itemsize == np.dtype(dtype).itemsize


def test_several_datasets_are_read_one_after_the_other(tmp_path):
    a = write_megatron(tmp_path / "a", DOCS)
    b = write_megatron(tmp_path / "b", [[[300, 301, 0]]], np.int32)
    s = indexed_tokens([a, b])
    assert s.read(0, len(s)).tolist() == IDS + [300, 301, 0] and s.vocab_needed == 302


def test_multimodal_modes_are_allowed(tmp_path):
    s = indexed_tokens([write_megatron(tmp_path / "m", DOCS, modes=True)])
    assert s.read(0, len(s)).tolist() == IDS


@pytest.mark.parametrize("damage, match", [
    ({"magic": b"TNTIDX\x00\x00\x00"}, r"m\.idx: not a Megatron index"),
    ({"version": 2}, r"m\.idx: index version 2"),
    ({"dtype": np.float32}, r"m\.idx: the \.bin holds float32 values, not token ids"),
    ({"pointers": [0, 8, 12, 20]}, r"m\.idx: sequence 3 starts at byte 20 of the \.bin, not right after the "
                                   r"sequence before it \(byte 18\)"),
])
def test_a_foreign_or_damaged_index_is_refused_by_name(tmp_path, damage, match):
    prefix = write_megatron(tmp_path / "m", DOCS, **damage)
    with pytest.raises(DataError, match=match):
        indexed_tokens([prefix])


def test_truncated_files_and_a_missing_half_are_named(tmp_path):
    prefix = write_megatron(tmp_path / "m", DOCS)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x01\x00")
    with pytest.raises(DataError, match=r"m\.bin: 24 bytes, but .*m\.idx records 11 uint16 ids \(22 bytes\)"):
        indexed_tokens([prefix])
    prefix = write_megatron(tmp_path / "m", DOCS)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(60)
    with pytest.raises(DataError, match=r"m\.idx: 60 bytes, but an index of 4 sequences and 4 document entries"):
        indexed_tokens([prefix])
    (tmp_path / "lone.bin").write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match=r"lone\.idx: not found \(data.kind = 'indexed' reads PREFIX\.idx"):
        indexed_tokens([str(tmp_path / "lone")])


def test_the_trainer_draws_the_same_batches_as_from_a_flat_bin(tmp_path):
    """Megatron's .bin + .idx and a flat .bin of the same ids (kind "tokens") give the trainer the
    same vocabulary, training batches and held-out windows."""
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    rng = np.random.default_rng(0)
    docs = [[rng.integers(1, 200, int(rng.integers(3, 40))).tolist() + [0]] for _ in range(60)]
    prefix = write_megatron(tmp_path / "c", docs)
    flat = tmp_path / "flat.bin"
    flat.write_bytes(np.array([i for d in docs for s in d for i in s], dtype=np.uint16).tobytes())
    base = {"run": {"out": str(tmp_path / "out"), "steps": 2},
            "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
            "data": {"kind": "tokens", "train": str(flat), "seq_len": 16, "global_batch": 4}}
    as_flat = prepare(load(write_config(tmp_path / "t.toml", base)), 1)
    base["data"].update(kind="indexed", train=prefix)
    as_indexed = prepare(load(write_config(tmp_path / "i.toml", base)), 1)
    assert as_indexed.vocab_data == as_flat.vocab_data == max(i for d in docs for s in d for i in s) + 1
    for step in range(3):
        assert as_indexed.train.windows(step).tolist() == as_flat.train.windows(step).tolist()
    assert [w.tolist() for w in as_indexed.valid] == [w.tolist() for w in as_flat.valid]
