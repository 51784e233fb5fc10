"""Token streams: where the trainer's tokens come from.

A stream is a flat sequence of token ids read lazily: a Megatron / nanoGPT ``.bin`` file
(memory-mapped), or plain text files tokenized by bytes or by a Hugging Face tokenizer
(optionally cached as a ``.bin``). Documents are packed: concatenated, with a Hugging Face
tokenizer's EOS after each (when it has one), so a training window may span two documents. Bytes
have no separator: the 256 byte values are the whole vocabulary, and an EOS id of 256 would
make it 257, which no tensor-parallel split of the bundled GPT divides (and which would make the
model's shape depend on a separator)."""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
import time

import numpy as np

from fxmegatron.errors import DataError
from fxmegatron.train.token_files import TOKEN_DTYPES, atomic_write, open_tokens, read_sidecar, write_tokens

# A full scan of a multi-GB memmap in one .max() would page the whole file in at once.
_SCAN_CHUNK = 1 << 22
# Bumped whenever the cache's content for the same inputs would change (2: the sidecar of
# token_files, KEY.bin.json, in place of KEY.json).
_CACHE_FORMAT = 2
# Bumped whenever a stream's content hash for the same tokens would change, so a cached digest
# of another format is never taken for this one.
_FINGERPRINT_FORMAT = 1
# A file modified this recently may be modified again within the same timestamp tick (Linux stamps
# files with a coarse clock): its digest is not cached, as git does not trust a "racily clean" file.
_RACY_NS = 2_000_000_000


class TokenStream:
    """A 1-D stream of token ids: one or more arrays (memmaps or in memory) read as one.

    ``name`` is what errors say (a path, or ``path[a:b]`` for a split)."""

    def __init__(self, parts, name: str = "<array>"):
        if isinstance(parts, np.ndarray):
            parts = [parts]
        self._parts = [p for p in parts if len(p)]
        for p in self._parts:
            if p.ndim != 1 or p.dtype.kind not in "iu":
                raise DataError(f"{name}: a token stream must be 1-D integers, got {p.dtype} of shape {p.shape}")
        # Start offset of each part in the concatenation, for bisect in read().
        self._starts = np.cumsum([0] + [len(p) for p in self._parts]).tolist()
        # A view (split_stream) shares the parts and reads [_lo, _hi) of them.
        self._lo, self._hi = 0, self._starts[-1]
        self.name = name
        self._vocab_needed: int | None = None
        self._content: str | None = None        # content_sha256, once computed
        # What an error about its ids adds: how to read the file otherwise, when nothing
        # recorded its dtype (token_files.open_tokens).
        self.dtype_hint = ""

    def __len__(self) -> int:
        return self._hi - self._lo

    def __repr__(self) -> str:
        return f"TokenStream({self.name!r}, {len(self)} tokens)"

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as an int64 copy (never a view of a memmap)."""
        if start < 0 or length < 0 or start + length > len(self):
            raise DataError(f"{self.name}: read of [{start}, {start + length}) outside its {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        pos, end, filled = self._lo + start, self._lo + start + length, 0
        k = bisect.bisect_right(self._starts, pos) - 1
        while filled < length:
            part, base = self._parts[k], self._starts[k]
            take = min(end, base + len(part)) - pos
            out[filled:filled + take] = part[pos - base:pos - base + take]
            filled, pos, k = filled + take, pos + take, k + 1
        return out

    def _chunks(self, start: int = 0, stop: int | None = None):
        stop = len(self) if stop is None else stop
        for a in range(start, stop, _SCAN_CHUNK):
            yield self.read(a, min(_SCAN_CHUNK, stop - a))

    @property
    def vocab_needed(self) -> int:
        """Max token id present + 1: the smallest vocabulary this stream fits."""
        if self._vocab_needed is None:
            m = -1
            for chunk in self._chunks():
                m = max(m, int(chunk.max()))
            self._vocab_needed = m + 1
        return self._vocab_needed

    def view(self, start: int, stop: int, name: str | None = None) -> "TokenStream":
        """Tokens [start, stop) of this stream, sharing its arrays."""
        v = TokenStream.__new__(TokenStream)
        v.__dict__.update(self.__dict__)
        v._lo, v._hi = self._lo + start, self._lo + stop
        if not self._lo <= v._lo <= v._hi <= self._hi:
            raise DataError(f"{self.name}: view [{start}, {stop}) outside its {len(self)} tokens")
        v.name = name or f"{self.name}[{start}:{stop}]"
        v._vocab_needed = v._content = None
        return v

    def fingerprint(self, cache_dir: str | None = None) -> dict:
        """What a checkpoint records to refuse a resume on other data: the length, ``sha256`` of
        the first and last 4096 tokens as int64 (all that checkpoints before ``content_sha256``
        recorded; kept so that theirs still compare) and ``content_sha256``, a hash of every token
        as little-endian uint32 (the same tokens stored as uint16 or uint32 agree), which catches
        an edit anywhere. The full hash reads the whole stream once: with ``cache_dir`` its digest
        is kept there, keyed by each file's path, size, mtime, ctime and inode, so a resume on an
        unchanged corpus only stats its files."""
        h = hashlib.sha256()
        n = len(self)
        h.update(self.read(0, min(4096, n)).tobytes())
        h.update(self.read(max(0, n - 4096), min(4096, n)).tobytes())
        if self._content is None:
            self._content = self._cached_content(cache_dir) if cache_dir else self._content_sha256()
        return {"length": n, "sha256": h.hexdigest(), "content_sha256": self._content}

    def _content_sha256(self) -> str:
        h = hashlib.sha256()
        narrow = all(p.dtype.kind == "u" and p.dtype.itemsize <= 4 for p in self._parts)
        for chunk in self._chunks():
            if not narrow and len(chunk) and (int(chunk.min()) < 0 or int(chunk.max()) >= 1 << 32):
                bad = int(chunk.min()) if int(chunk.min()) < 0 else int(chunk.max())
                raise DataError(f"{self.name}: token id {bad} is outside [0, 2**32): not a token stream")
            h.update(chunk.astype("<u4").tobytes())
        return h.hexdigest()

    def _files_key(self):
        """What the content hash depends on, or None when a part is not a file (then no cache)."""
        files = []
        for p in self._parts:
            path = getattr(p, "filename", None)
            if path is None:
                return None
            st = os.stat(path)
            files.append([os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                          p.dtype.str, int(getattr(p, "offset", 0)), len(p)])
        return {"format": _FINGERPRINT_FORMAT, "files": files, "range": [self._lo, self._hi]}

    def _cached_content(self, cache_dir: str) -> str:
        key = self._files_key()
        if key is None:
            return self._content_sha256()
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        path = os.path.join(cache_dir, f"fingerprint-{name}.json")
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with _exclusive(path + ".lock"):    # one rank per host reads the corpus, the others wait
                try:
                    with open(path) as f:
                        saved = json.load(f)
                    if saved.get("key") == key:
                        return saved["content_sha256"]
                except (OSError, ValueError, KeyError, AttributeError):
                    pass
                digest = self._content_sha256()
                now = time.time_ns()
                if self._files_key() == key and all(now - f[2] > _RACY_NS for f in key["files"]):
                    try:
                        entry = json.dumps({"key": key, "content_sha256": digest}).encode()
                        atomic_write(path, lambda f: f.write(entry))
                    except OSError:
                        pass    # an unwritable cache costs the full read on every start, never a wrong answer
                return digest
        except OSError:         # no cache folder: the same
            return self._content_sha256()


def memmap_tokens(path: str, dtype: str) -> TokenStream:
    """A flat ``.bin`` of uint16 or uint32 tokens without header (Megatron's and nanoGPT's
    convention), memory-mapped read-only, after ``token_files.open_tokens``'s checks of its dtype."""
    path = os.fspath(path)
    arr, hint = open_tokens(path, dtype)
    stream = TokenStream(arr, name=path)
    stream.dtype_hint = hint
    return stream


# --- text ------------------------------------------------------------------------------------

def _load_tokenizer(tokenizer: str):
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
    tok = _load_tokenizer(src)
    try:
        written = tok.save_pretrained(dst)
    except OSError as e:
        raise DataError(f"{dst}: cannot write the tokenizer of {src} there: {e}") from e
    # save_pretrained may convert (a slow tokenizer's files to tokenizer.json): what was
    # written must read back as the same vocabulary.
    if _load_tokenizer(dst).get_vocab() != tok.get_vocab():
        raise DataError(f"{dst}: the tokenizer written from {src} does not read back with the same vocabulary")
    return sorted(os.path.basename(p) for p in written)


def tokenizer_vocab_size(tokenizer: str) -> int:
    """256 for ``"bytes"``; ``len(tokenizer)`` (added tokens included) for a directory."""
    if tokenizer == "bytes":
        return 256
    return len(_load_tokenizer(tokenizer))


def _check_text_paths(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError("text data: no files given")
    for p in paths:
        if not os.path.isfile(p):
            raise DataError(f"{p}: text file not found")
    return paths


def _name(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more files)"


def _tokenize_file(tok, path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    # No BOS/EOS from the tokenizer itself: Megatron's and nanoGPT's packing add only the
    # end-of-document token, after each document. verbose=False: a whole file is longer
    # than model_max_length by design.
    return tok(text, add_special_tokens=False, verbose=False)["input_ids"]


def _documents(paths: list[str], tok, dt: np.dtype):
    """Each file's tokens followed by EOS (when the tokenizer has one), as ``dt`` arrays."""
    eos = tok.eos_token_id
    for p in paths:
        ids = _tokenize_file(tok, p)
        if eos is not None:
            ids = list(ids) + [eos]
        arr = np.asarray(ids, dtype=np.int64)
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


def cache_key(paths: list[str], tokenizer: str) -> str:
    """sha256 of the inputs: each file's absolute path, size and mtime, and the tokenizer
    directory's content. An edited file or tokenizer gets a new key, never a stale cache."""
    files = []
    for p in paths:
        st = os.stat(p)
        files.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    desc = {"format": _CACHE_FORMAT, "files": files, "tokenizer": _dir_sha256(tokenizer)}
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


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Hold an exclusive lock so that, of the ranks of one host, one tokenizes and the
    others wait and then read its cache. Where flock is missing or does not work (some
    network filesystems) every rank tokenizes; that stays correct because writes are atomic
    and their content identical."""
    try:
        import fcntl
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)   # releases the lock


def _hf_dtype(tok) -> np.dtype:
    top = max(len(tok), (tok.eos_token_id or 0) + 1)
    return TOKEN_DTYPES["uint16" if top <= 1 << 16 else "uint32"]


def _cached_hf_tokens(paths: list[str], tokenizer: str, cache_dir: str) -> np.ndarray:
    try:
        return _cached_hf_tokens_in(paths, tokenizer, cache_dir)
    except OSError as e:
        raise DataError(f"{cache_dir}: cannot read or write the token cache there: {e}") from e


def _cached_hf_tokens_in(paths: list[str], tokenizer: str, cache_dir: str) -> np.ndarray:
    os.makedirs(cache_dir, exist_ok=True)
    key = cache_key(paths, tokenizer)
    bin_path = os.path.join(cache_dir, key + ".bin")
    arr = _read_cache(bin_path)
    if arr is not None:
        return arr
    with _exclusive(os.path.join(cache_dir, key + ".lock")):
        arr = _read_cache(bin_path)   # another rank may have written it meanwhile
        if arr is not None:
            return arr
        tok = _load_tokenizer(tokenizer)
        dt = _hf_dtype(tok)
        meta = {"cache_format": _CACHE_FORMAT, "files": [os.path.abspath(p) for p in paths],
                "tokenizer": os.path.abspath(tokenizer), "eos_token_id": tok.eos_token_id}
        if write_tokens(bin_path, _documents(paths, tok, dt), dt.name, meta) == 0:
            raise DataError(f"{_name(paths)}: the text files hold no tokens")
    arr = _read_cache(bin_path)
    if arr is None:
        raise DataError(f"{bin_path}: token cache unreadable right after writing it")
    return arr


def text_tokens(paths: list[str], tokenizer: str, cache_dir: str | None = None) -> TokenStream:
    """Plain text files as one packed stream.

    ``tokenizer="bytes"``: the files' bytes joined with no separator (vocab 256: every id is a
    byte value, none is left for an EOS), memory-mapped, so no cache is needed. Otherwise
    ``tokenizer`` is a directory saved by ``save_pretrained``; each file is one document,
    followed by the tokenizer's EOS when it has one. With ``cache_dir`` the tokens are written
    once to ``cache_dir/<key>.bin`` (see ``cache_key``) and memory-mapped on later calls, from
    any rank."""
    paths = _check_text_paths(paths)
    name = _name(paths)
    if tokenizer == "bytes":
        parts = [np.memmap(p, dtype=np.uint8, mode="r") for p in paths if os.path.getsize(p)]
        if not parts:
            raise DataError(f"{name}: the text files are empty")
        return TokenStream(parts, name=name)
    if cache_dir is not None:
        return TokenStream(_cached_hf_tokens(paths, os.fspath(tokenizer), os.fspath(cache_dir)), name=name)
    tok = _load_tokenizer(tokenizer)
    parts = list(_documents(paths, tok, _hf_dtype(tok)))
    if not any(len(p) for p in parts):
        raise DataError(f"{name}: the text files hold no tokens")
    return TokenStream(parts, name=name)


def split_stream(stream: TokenStream, valid_fraction: float) -> tuple[TokenStream, TokenStream]:
    """(train, valid): the last ``valid_fraction`` of the tokens is held out; no token is
    in both. The cut is a token boundary, not a document one, as Megatron's is not either."""
    if not 0.0 < valid_fraction < 1.0:
        raise DataError(f"{stream.name}: valid_fraction must be in (0, 1), got {valid_fraction}")
    n = len(stream)
    n_valid = int(round(n * valid_fraction))
    if n_valid < 1 or n_valid >= n:
        raise DataError(f"{stream.name}: {n} tokens are too few to hold out {valid_fraction} of them "
                        f"with tokens left on both sides")
    cut = n - n_valid
    return (stream.view(0, cut, f"{stream.name}[:{cut}] (train)"),
            stream.view(cut, n, f"{stream.name}[{cut}:] (valid)"))
