"""Documents made token streams: plain text files (a file is a document), and records (a
record's text field is a document) of JSON Lines, Parquet files or ``datasets`` folders
(``records.py``), tokenized by bytes or by a Hugging Face tokenizer.

Bytes: the documents' UTF-8 bytes joined with no separator (vocabulary 256). A Hugging Face
tokenizer: each document's tokens, without the tokenizer's own BOS/EOS, followed by its EOS
when it has one (Megatron's and nanoGPT's packing). With a cache folder the tokens are written
once per host (one rank tokenizes, the others wait and read) to ``<key>.bin`` and
memory-mapped after."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterator, Optional

import numpy as np

from fxmegatron.errors import DataError
from fxmegatron.train.records import dataset_texts, parquet_texts
from fxmegatron.train.token_files import TOKEN_DTYPES, exclusive, read_sidecar, write_tokens
from fxmegatron.train.tokens import TokenStream

# Bumped whenever the cache's content for the same inputs would change (2: the sidecar of
# token_files, KEY.bin.json, in place of KEY.json).
_CACHE_FORMAT = 2


def load_tokenizer(tokenizer: str):
    if not os.path.isdir(tokenizer):
        raise DataError(f"{tokenizer}: tokenizer must be 'bytes' or a directory saved with "
                        f"save_pretrained; no such directory")
    from transformers import AutoTokenizer   # slow import, only when a tokenizer is used
    try:
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"{tokenizer}: cannot load a Hugging Face tokenizer from it: {e}") from e


def save_tokenizer(src: str, dst: str) -> list[str]:
    """The tokenizer of directory ``src`` written to ``dst`` by its own ``save_pretrained``;
    returns the file names written. Copying the folder would be wrong: a tokenizer often lives
    in the model's folder (the fine-tune recipe), and its weights and config.json must never
    travel with it, where they could replace a trained model's."""
    tok = load_tokenizer(src)
    try:
        written = tok.save_pretrained(dst)
    except OSError as e:
        raise DataError(f"{dst}: cannot write the tokenizer of {src} there: {e}") from e
    # save_pretrained may convert (a slow tokenizer's files to tokenizer.json): what was
    # written must read back as the same vocabulary.
    if load_tokenizer(dst).get_vocab() != tok.get_vocab():
        raise DataError(f"{dst}: the tokenizer written from {src} does not read back with the same vocabulary")
    return sorted(os.path.basename(p) for p in written)


def tokenizer_vocab_size(tokenizer: str) -> int:
    """256 for ``"bytes"``; ``len(tokenizer)`` (added tokens included) for a directory."""
    if tokenizer == "bytes":
        return 256
    return len(load_tokenizer(tokenizer))


def check_text_paths(paths, kind: str = "text") -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError(f"{kind} data: no files given")
    for p in paths:
        if kind == "hf_dataset" and not os.path.isdir(p):
            raise DataError(f"{p}: no such folder (data.kind = 'hf_dataset' reads folders written by save_to_disk)")
        if kind != "hf_dataset" and not os.path.isfile(p):
            raise DataError(f"{p}: {kind} file not found")
    return paths


def paths_name(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more files)"


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e


def jsonl_records(path: str) -> Iterator[tuple[str, object]]:
    """``(where, record)`` of every line of a JSON Lines file, in order (blank lines skipped),
    ``where`` being ``path:line``; a line that is not JSON is refused, naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{no}: not a JSON record ({e})") from e
                yield f"{path}:{no}", rec
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e


def jsonl_texts(path: str, field: str) -> Iterator[str]:
    """The ``field`` of every record of a JSON Lines file, in order (blank lines skipped); a line
    that is not a JSON object with a string ``field`` is refused, naming the file and line."""
    for where, rec in jsonl_records(path):
        text = rec.get(field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise DataError(f"{where}: the record has no string field {field!r} (data.text_field); it has {have}")
        yield text


# Each record kind's reader: (path, field) -> the records' texts, in order.
RECORD_READERS = {"jsonl": jsonl_texts, "parquet": parquet_texts, "hf_dataset": dataset_texts}
_RECORD_NAMES = {"jsonl": "JSON Lines files", "parquet": "Parquet files", "hf_dataset": "datasets folders"}


def _texts(field: Optional[str], kind: str = "jsonl") -> Callable[[str], Iterator[str]]:
    """A file's documents: the whole file (``field`` None: plain text), or each record's
    ``field`` (``kind``: one of RECORD_READERS)."""
    if field is None:
        return lambda path: iter([_read_text(path)])
    read = RECORD_READERS[kind]
    return lambda path: read(path, field)


def _tokenize_file(tok, path: str, texts: Callable[[str], Iterator[str]]) -> list[int]:
    """A file's tokens: each document's, followed by EOS (when the tokenizer has one). No
    BOS/EOS from the tokenizer itself: Megatron's and nanoGPT's packing add only the
    end-of-document token. verbose=False: a document may be longer than model_max_length."""
    eos, ids = tok.eos_token_id, []
    for text in texts(path):
        ids.extend(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return ids


def _documents(paths: list[str], tok, dt: np.dtype, texts):
    """Each file's tokens (``_tokenize_file``), as ``dt`` arrays."""
    for p in paths:
        arr = np.asarray(_tokenize_file(tok, p, texts), dtype=np.int64)
        if len(arr) and (arr.min() < 0 or arr.max() > np.iinfo(dt).max):
            raise DataError(f"{p}: token id {int(arr.max())} does not fit {dt.name}")
        yield arr.astype(dt)


def _dir_sha256(d: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(d):
        dirs.sort()
        for f in sorted(files):
            full = os.path.join(root, f)
            h.update(os.path.relpath(full, d).encode() + b"\0")
            with open(full, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _stat_files(path: str) -> list:
    """[absolute path, size, mtime] of the file, or of every file under the folder (a datasets
    folder rewritten in place keeps its own mtime; its files' change)."""
    if not os.path.isdir(path):
        st = os.stat(path)
        return [[os.path.abspath(path), st.st_size, st.st_mtime_ns]]
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            out += _stat_files(os.path.join(root, f))
    return out


def cache_key(paths: list[str], tokenizer: str, field: Optional[str] = None, kind: str = "jsonl") -> str:
    """sha256 of the inputs: each file's absolute path, size and mtime (every file of a folder),
    the tokenizer directory's content and, for records, the kind and text field. An edited file
    or tokenizer gets a new key, never a stale cache. (JSON Lines' key names only its field, as
    it did before the other record kinds, so that existing caches stay valid.)"""
    files = [f for p in paths for f in _stat_files(p)]
    desc = {"format": _CACHE_FORMAT, "files": files, "tokenizer": _dir_sha256(tokenizer)}
    if field is not None:
        desc[f"{kind}_field"] = field
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _read_cache(bin_path: str):
    """The cached stream, or None when absent or inconsistent (then it is rewritten)."""
    try:
        meta = read_sidecar(bin_path)
        if meta is None:
            return None
        dt = TOKEN_DTYPES[meta["dtype"]]
        if os.path.getsize(bin_path) != meta["tokens"] * dt.itemsize:
            return None
        return np.memmap(bin_path, dtype=dt, mode="r")
    except (OSError, ValueError, DataError):
        return None


def _hf_dtype(tok) -> np.dtype:
    top = max(len(tok), (tok.eos_token_id or 0) + 1)
    return TOKEN_DTYPES["uint16" if top <= 1 << 16 else "uint32"]


def _cached_hf_tokens(paths: list[str], tokenizer: str, cache_dir: str, field: Optional[str],
                      kind: str = "jsonl") -> np.ndarray:
    try:
        return _cached_hf_tokens_in(paths, tokenizer, cache_dir, field, kind)
    except OSError as e:
        raise DataError(f"{cache_dir}: cannot read or write the token cache there: {e}") from e


def _cached_hf_tokens_in(paths: list[str], tokenizer: str, cache_dir: str, field: Optional[str],
                         kind: str) -> np.ndarray:
    os.makedirs(cache_dir, exist_ok=True)
    key = cache_key(paths, tokenizer, field, kind)
    bin_path = os.path.join(cache_dir, key + ".bin")
    arr = _read_cache(bin_path)
    if arr is not None:
        return arr
    with exclusive(os.path.join(cache_dir, key + ".lock")):
        arr = _read_cache(bin_path)   # another rank may have written it meanwhile
        if arr is not None:
            return arr
        tok = load_tokenizer(tokenizer)
        dt = _hf_dtype(tok)
        meta = {"cache_format": _CACHE_FORMAT, "files": [os.path.abspath(p) for p in paths],
                "tokenizer": os.path.abspath(tokenizer), "eos_token_id": tok.eos_token_id}
        if field is not None:
            meta[f"{kind}_field"] = field
        if write_tokens(bin_path, _documents(paths, tok, dt, _texts(field, kind)), dt.name, meta) == 0:
            raise DataError(f"{paths_name(paths)}: the files hold no tokens")
    arr = _read_cache(bin_path)
    if arr is None:
        raise DataError(f"{bin_path}: token cache unreadable right after writing it")
    return arr


def text_tokens(paths: list[str], tokenizer: str, cache_dir: str | None = None) -> TokenStream:
    """Plain text files as one packed stream, each file one document.

    ``tokenizer="bytes"``: the files' bytes joined with no separator (vocab 256: every id is a
    byte value, none is left for an EOS), memory-mapped, so no cache is needed. Otherwise
    ``tokenizer`` is a directory saved by ``save_pretrained``; each file is followed by the
    tokenizer's EOS when it has one. With ``cache_dir`` the tokens are written once to
    ``cache_dir/<key>.bin`` (see ``cache_key``) and memory-mapped on later calls, from any rank."""
    paths = check_text_paths(paths)
    name = paths_name(paths)
    if tokenizer == "bytes":
        parts = [np.memmap(p, dtype=np.uint8, mode="r") for p in paths if os.path.getsize(p)]
        if not parts:
            raise DataError(f"{name}: the text files are empty")
        return TokenStream(parts, name=name)
    return _hf_stream(paths, os.fspath(tokenizer), cache_dir, None)


def record_tokens(kind: str, paths: list[str], tokenizer: str, field: str = "text",
                  cache_dir: str | None = None) -> TokenStream:
    """Files of records (``kind``: jsonl, parquet or hf_dataset) as one packed stream, each
    record's ``field`` one document, in file and record order: by bytes, the documents' UTF-8
    bytes joined with no separator; by a Hugging Face tokenizer, each followed by its EOS (when
    it has one), cached as ``text_tokens`` is."""
    paths = check_text_paths(paths, kind)
    name = paths_name(paths)
    if tokenizer == "bytes":
        read = RECORD_READERS[kind]
        data = b"".join(t.encode("utf-8") for p in paths for t in read(p, field))
        if not data:
            raise DataError(f"{name}: the {_RECORD_NAMES[kind]} hold no text in field {field!r}")
        return TokenStream(np.frombuffer(data, dtype=np.uint8), name=name)
    return _hf_stream(paths, os.fspath(tokenizer), cache_dir, field, kind)


def jsonl_tokens(paths: list[str], tokenizer: str, field: str = "text", cache_dir: str | None = None) -> TokenStream:
    """JSON Lines files as one packed stream (``record_tokens``)."""
    return record_tokens("jsonl", paths, tokenizer, field, cache_dir)


def _hf_stream(paths: list[str], tokenizer: str, cache_dir: str | None, field: Optional[str],
               kind: str = "jsonl") -> TokenStream:
    name = paths_name(paths)
    if cache_dir is not None:
        return TokenStream(_cached_hf_tokens(paths, tokenizer, os.fspath(cache_dir), field, kind), name=name)
    tok = load_tokenizer(tokenizer)
    parts = list(_documents(paths, tok, _hf_dtype(tok), _texts(field, kind)))
    if not any(len(p) for p in parts):
        raise DataError(f"{name}: the files hold no tokens")
    return TokenStream(parts, name=name)
