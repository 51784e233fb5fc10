"""Flat token files (``.bin``: ids without a header, Megatron's and nanoGPT's convention) and the
sidecar that says how to read them.

A flat file does not say its own dtype, and the wrong one reads as plausible ids: uint32 ids read
as uint16 are the ids with a 0 between each two, and trained on, they are garbage with a falling
loss. So every ``.bin`` fxmegatron writes gets ``PATH.json`` beside it (``write_tokens``):
``{"format": ..., "dtype": "uint32", "tokens": N}``, written after the ``.bin``; a reader
checks it against the dtype asked for and the file's size. A file without one (written by
other tools) is checked by what the wrong dtype leaves in it: a size that is not a whole
number of tokens, uint32 ids whose upper halves read as every second uint16 (all near 0), or
uint16 pairs read as uint32 (ids in the millions, beyond any vocabulary). Ids beyond the
model's vocabulary are refused by the trainer once the model is known, with ``dtype_hint``."""
from __future__ import annotations

import contextlib

import json
import os
import uuid
from typing import Iterable, Optional, Tuple

import numpy as np

from fxmegatron.errors import DataError

# Explicit little-endian: nanoGPT and Megatron write native order on x86, and a file must
# read the same on every host.
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SIDECAR_FORMAT = "fxmegatron-tokens/1"
# How far into a file without a sidecar the dtype checks look: the first 4 MiB of uint16.
_SNIFF = 1 << 21
# uint32 ids read as uint16: their upper halves, every second value, are the id // 65536; no
# vocabulary reaches 4 * 65536 ids, and a real uint16 stream never keeps every second id that low
# over this many pairs while the others rise above it.
_HIGH_HALF_BELOW, _MIN_PAIRS = 4, 64
# uint16 pairs read as uint32: id = a + 65536 * b, in the millions for any b >= 256.
_MAX_PLAUSIBLE_ID = 1 << 24


def check_dtype(dtype, where: str) -> np.dtype:
    name = str(dtype)
    if name not in TOKEN_DTYPES:
        raise DataError(f"{where}: token dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    return TOKEN_DTYPES[name]


def sidecar_path(path: str) -> str:
    return os.fspath(path) + ".json"


def atomic_write(path: str, write) -> None:
    """``write(f)`` to a temporary file, then renamed over ``path``: a reader sees all or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_tokens(path: str, parts: Iterable, dtype: str, meta: Optional[dict] = None) -> int:
    """Write ``parts`` (arrays or lists of ids, concatenated) to the flat file ``path`` as
    ``dtype``, then its sidecar (with ``meta`` added); returns the token count. An id that does
    not fit ``dtype`` is a DataError. Nothing is left behind for zero tokens (the count is 0)."""
    path = os.fspath(path)
    dt = check_dtype(dtype, path)
    count = 0

    def write_bin(f):
        nonlocal count
        for part in parts:
            arr = np.asarray(part, dtype=np.int64)
            if len(arr) and (arr.min() < 0 or arr.max() > np.iinfo(dt).max):
                bad = int(arr.max()) if arr.max() > np.iinfo(dt).max else int(arr.min())
                raise DataError(f"{path}: token id {bad} does not fit {dt.name}")
            arr.astype(dt).tofile(f)
            count += len(arr)

    atomic_write(path, write_bin)
    if count == 0:
        os.remove(path)
        return 0
    side = {**(meta or {}), "format": SIDECAR_FORMAT, "dtype": dt.name, "tokens": count}
    # The sidecar goes last: a reader that finds it knows the .bin is complete.
    atomic_write(sidecar_path(path), lambda f: f.write(json.dumps(side, indent=1).encode()))
    return count


def read_sidecar(path: str) -> Optional[dict]:
    """``PATH.json`` checked (a known dtype, a whole token count), or None when there is none."""
    side = sidecar_path(path)
    if not os.path.exists(side):
        return None
    try:
        with open(side) as f:
            meta = json.load(f)
        check_dtype(meta["dtype"], side)
        if isinstance(meta["tokens"], bool) or not isinstance(meta["tokens"], int) or meta["tokens"] < 0:
            raise ValueError(f"tokens = {meta['tokens']!r}")
    except (OSError, ValueError, KeyError, TypeError, DataError) as exc:
        raise DataError(f"{side}: not a token file's sidecar ({type(exc).__name__}: {exc}); it must be "
                        '{"dtype": "uint16" or "uint32", "tokens": N}') from exc
    return meta


def open_tokens(path: str, dtype: str) -> Tuple[np.ndarray, str]:
    """``path`` memory-mapped as ``dtype`` after every check above; returns the array and the hint
    for an error about its ids ("" when a sidecar vouches for the dtype)."""
    path = os.fspath(path)
    dt = check_dtype(dtype, path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: token file not found")
    size = os.path.getsize(path)
    meta = read_sidecar(path)
    if meta is not None:
        side = sidecar_path(path)
        if meta["dtype"] != dt.name:
            raise DataError(f'{path}: {side} records {meta["dtype"]} tokens, but they are to be read as '
                            f'{dt.name}: set data.token_dtype = "{meta["dtype"]}"')
        if size != meta["tokens"] * dt.itemsize:
            raise DataError(f"{path}: {size} bytes, but {side} records {meta['tokens']} {dt.name} tokens "
                            f"({meta['tokens'] * dt.itemsize} bytes): a truncated or replaced file")
    if size == 0:
        raise DataError(f"{path}: token file is empty")
    if size % dt.itemsize:
        hint = ('a uint16 file? set data.token_dtype = "uint16"' if size % 2 == 0 else
                "no whole number of uint16 or uint32 tokens: a truncated or foreign file")
        raise DataError(f"{path}: size {size} bytes is not a multiple of {dt.itemsize} (the size of one "
                        f"{dt.name} token): {hint}")
    arr = np.memmap(path, dtype=dt, mode="r")
    if meta is not None:
        return arr, ""
    _sniff(path, arr, dt)
    other = "uint32" if dt.itemsize == 2 else "uint16"
    return arr, (f' (no {os.path.basename(sidecar_path(path))} records its dtype: if the file holds {other} '
                 f'ids, set data.token_dtype = "{other}")')


def _sniff(path: str, arr: np.ndarray, dt: np.dtype) -> None:
    sample = np.asarray(arr[:_SNIFF])
    fix = f'; if it really is {dt.name}, write {sidecar_path(path)} {{"dtype": "{dt.name}", "tokens": {len(arr)}}}'
    if dt.itemsize == 2 and len(sample) >= 2 * _MIN_PAIRS:
        n = len(sample) // 2 * 2
        low, high = sample[0:n:2], sample[1:n:2]
        if int(high.max()) < _HIGH_HALF_BELOW <= int(low.max()):
            raise DataError(f"{path}: read as uint16, every second id of the first {n} is below "
                            f"{_HIGH_HALF_BELOW} while the others reach {int(low.max())}: the upper halves of "
                            f'uint32 ids; set data.token_dtype = "uint32"{fix}')
    if dt.itemsize == 4 and len(sample) and int(sample.max()) >= _MAX_PLAUSIBLE_ID:
        raise DataError(f"{path}: read as uint32 it holds id {int(sample.max())}, beyond any vocabulary: pairs "
                        f'of uint16 ids; set data.token_dtype = "uint16"{fix}')


@contextlib.contextmanager
def exclusive(lock_path: str):
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
