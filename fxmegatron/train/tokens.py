"""Token streams: where the trainer's tokens come from.

A stream is a flat sequence of token ids read lazily: a Megatron / nanoGPT ``.bin`` file
(memory-mapped), or documents (text files, JSON Lines records) tokenized by bytes or by a
Hugging Face tokenizer (``documents.py``, optionally cached as a ``.bin``). Documents are
packed: concatenated, with a Hugging Face tokenizer's EOS after each (when it has one), so a
training window may span two documents. Bytes have no separator: the 256 byte values are the
whole vocabulary, and an EOS id of 256 would make it 257, which no tensor-parallel split of the
bundled GPT divides (and which would make the model's shape depend on a separator)."""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import time

import numpy as np

from fxmegatron.errors import DataError
from fxmegatron.train.token_files import atomic_write, exclusive, open_tokens

# A full scan of a multi-GB memmap in one .max() would page the whole file in at once.
_SCAN_CHUNK = 1 << 22
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
                # a token masked from the loss is stored as ~id (chat.py): its id is ~min
                m = max(m, int(chunk.max()), ~int(chunk.min()))
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
            # a masked token's ~id (chat.py, int32) wraps to 2**32 - 1 - id, which no id of its stream
            # reaches: the hash sees the mask too, and a plain stream hashes as before
            if not narrow and len(chunk) and (int(chunk.min()) < -(1 << 31) or int(chunk.max()) >= 1 << 32):
                bad = int(chunk.min()) if int(chunk.min()) < -(1 << 31) else int(chunk.max())
                raise DataError(f"{self.name}: token id {bad} is outside [-2**31, 2**32): not a token stream")
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
            with exclusive(path + ".lock"):    # one rank per host reads the corpus, the others wait
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
