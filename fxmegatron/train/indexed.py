"""Megatron's indexed datasets (``data.kind = "indexed"``): a ``PREFIX.bin`` of token ids and its
``PREFIX.idx``, as Megatron-LM's ``tools/preprocess_data.py`` writes them (Megatron-core's
``IndexedDataset``; fairseq's and Megatron-DeepSpeed's ``MMapIndexedDataset`` before it).

The ``.idx``, little-endian: the 9 bytes ``MMIDIDX\\0\\0``, the version (u64, 1), the dtype code
of the ``.bin`` (u8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16; 6 and 7 are floats),
the sequence count n (u64), the document count d (u64), then n sequence lengths (int32), n byte
offsets into the ``.bin`` (int64), d document indices (int64: document k is sequences
``[doc[k], doc[k + 1])``, the first 0, the last n), and for multimodal data n modes (int8).

The stream is every sequence in order, packed as the other kinds are; the preprocessing already
put an end-of-document id after each document (``--append-eod``) where it was asked to. The
``.bin`` is memory-mapped, never read whole. What Megatron's reader would accept silently and
this one refuses, naming the file: an index that does not account for its file's size, a
``.bin`` of another length than its sequences, and sequences that are not stored one after the
other (the stream reads the ``.bin`` as one array)."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from fxmegatron.errors import DataError
from fxmegatron.train.tokens import TokenStream

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLOAT_CODES = {6: "float64", 7: "float32"}


@dataclass(frozen=True)
class IndexedFile:
    """One indexed dataset: its ``.bin`` path, the ids' dtype, each sequence's length in ids and
    each document's first sequence (``documents``, d entries: the last is the sequence count)."""

    bin_path: str
    dtype: np.dtype
    lengths: np.ndarray
    documents: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))


def prefix_of(path: str) -> str:
    """``PREFIX`` from ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` (Megatron's data paths are
    prefixes)."""
    path = os.fspath(path)
    root, ext = os.path.splitext(path)
    return root if ext in (".bin", ".idx") else path


def read_index(path: str) -> IndexedFile:
    """The index of the indexed dataset at ``path`` (a prefix, or its ``.bin`` or ``.idx``),
    checked against its ``.bin``; raises DataError naming the file and what is wrong."""
    prefix = prefix_of(path)
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for p in (idx, bin_path):
        if not os.path.isfile(p):
            raise DataError(f"{p}: not found (data.kind = 'indexed' reads PREFIX.idx and PREFIX.bin, as "
                            "Megatron's preprocess_data.py writes them; give PREFIX or either file)")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
        raise DataError(f"{idx}: not a Megatron index (it does not start with {MAGIC!r}): data.kind = 'indexed' "
                        "reads the .idx/.bin pairs of Megatron's preprocess_data.py; a flat file of ids is "
                        "data.kind = 'tokens'")
    version, code, n, d = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != 1:
        raise DataError(f"{idx}: index version {version}; only version 1 (Megatron-LM's) is known")
    if code in FLOAT_CODES:
        raise DataError(f"{idx}: the .bin holds {FLOAT_CODES[code]} values, not token ids")
    if code not in DTYPES:
        raise DataError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    body = HEADER_BYTES + 12 * n + 8 * d
    if size not in (body, body + n):        # + n: one mode byte per sequence (multimodal data)
        raise DataError(f"{idx}: {size} bytes, but an index of {n} sequences and {d} document entries takes "
                        f"{body} (or {body + n} with modes): a truncated or foreign file")
    arr = np.memmap(idx, mode="r")
    lengths = np.frombuffer(arr, dtype="<i4", count=n, offset=HEADER_BYTES)
    pointers = np.frombuffer(arr, dtype="<i8", count=n, offset=HEADER_BYTES + 4 * n)
    documents = np.frombuffer(arr, dtype="<i8", count=d, offset=HEADER_BYTES + 12 * n)
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    if n and int(lengths.min()) < 0:
        raise DataError(f"{idx}: sequence {int(np.argmin(lengths))} has a negative length")
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=starts[1:])
    if not np.array_equal(pointers, starts * dtype.itemsize):
        k = int(np.argmax(pointers != starts * dtype.itemsize))
        raise DataError(f"{idx}: sequence {k} starts at byte {int(pointers[k])} of the .bin, not right after the "
                        f"sequence before it (byte {int(starts[k]) * dtype.itemsize}): only .bin files that store "
                        "their sequences one after the other are read")
    if d and (documents[0] != 0 or documents[-1] != n or np.any(np.diff(documents) < 0)):
        raise DataError(f"{idx}: its document indices do not run from 0 to the sequence count {n} in order")
    out = IndexedFile(bin_path, dtype, lengths, documents)
    if os.path.getsize(bin_path) != out.tokens * dtype.itemsize:
        raise DataError(f"{bin_path}: {os.path.getsize(bin_path)} bytes, but {idx} records {out.tokens} "
                        f"{dtype.name} ids ({out.tokens * dtype.itemsize} bytes): a truncated or replaced file")
    return out


def indexed_tokens(paths: Sequence[str]) -> TokenStream:
    """The sequences of every indexed dataset in ``paths``, in order, as one token stream (each
    ``.bin`` memory-mapped)."""
    parts: List[np.ndarray] = []
    for path in paths:
        index = read_index(path)
        if index.tokens:
            parts.append(np.memmap(index.bin_path, dtype=index.dtype, mode="r"))
    name = prefix_of(paths[0]) + (f" (+{len(paths) - 1} more)" if len(paths) > 1 else "")
    if not parts:
        raise DataError(f"{name}: the indexed dataset holds no tokens")
    return TokenStream(parts, name=name)
