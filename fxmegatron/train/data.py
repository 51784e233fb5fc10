"""The trainer's batches: packed windows of a token stream, drawn by a deterministic,
resumable sampler.

A window is ``seq_len + 1`` tokens (inputs and the labels shifted by one); windows do not
overlap except for that one token, and documents are concatenated across them (packing).
The batch of a step is a function of ``(seed, step)`` only, so a run resumed at any
(dp, pp, tp) layout, or one that skips steps, draws exactly the batches an uninterrupted
run would have. Token sources live in ``tokens.py`` and are re-exported here."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from fxmegatron.errors import DataError
from fxmegatron.train.documents import jsonl_tokens, text_tokens, tokenizer_vocab_size
from fxmegatron.train.tokens import TokenStream, memmap_tokens, split_stream

__all__ = ["TokenStream", "memmap_tokens", "text_tokens", "jsonl_tokens", "tokenizer_vocab_size", "split_stream",
           "Batches", "eval_windows", "num_windows"]

# Bumped when the batches drawn for the same (stream, seed, step) would change: a checkpoint
# from another sampler must not silently resume with other data.
_SAMPLER_FORMAT = 1


def positive_int(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DataError(f"{where}: {what} must be a positive integer, got {value!r}")
    return int(value)


def num_windows(stream: TokenStream, seq_len: int) -> int:
    """How many windows of ``seq_len + 1`` tokens, stepping by ``seq_len``, fit the stream."""
    seq_len = positive_int(seq_len, "seq_len", stream.name)
    return max(0, (len(stream) - 1) // seq_len)


def _read_windows(stream: TokenStream, seq_len: int, idx) -> torch.Tensor:
    rows = np.empty((len(idx), seq_len + 1), dtype=np.int64)
    for r, i in enumerate(idx):
        rows[r] = stream.read(int(i) * seq_len, seq_len + 1)
    return torch.from_numpy(rows)


def _too_few(stream: TokenStream, seq_len: int, n: int, global_batch: int) -> DataError:
    return DataError(f"{stream.name}: {len(stream)} tokens make {n} windows of seq_len+1 = {seq_len + 1} "
                     f"tokens, fewer than global_batch = {global_batch}; give more data or a smaller "
                     f"seq_len or global_batch")


class Batches:
    """Deterministic, resumable sampler over the packed windows of ``stream``.

    Window ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``; there are
    ``n = (len(stream) - 1) // seq_len`` of them. Step ``k`` takes positions
    ``[k*global_batch, (k+1)*global_batch)`` of an endless sequence of epochs; epoch ``e``
    is a permutation of ``range(n)`` drawn from ``Generator(PCG64([seed, e]))``, so every
    window is seen once per epoch and a step that straddles two epochs takes the end of one
    and the start of the next."""

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, seed: int):
        self.stream = stream
        self.seq_len = positive_int(seq_len, "seq_len", stream.name)
        self.global_batch = positive_int(global_batch, "global_batch", stream.name)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"{stream.name}: seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self.n = num_windows(stream, self.seq_len)
        if self.n < self.global_batch:
            raise _too_few(stream, self.seq_len, self.n, self.global_batch)
        # A step touches at most two epochs (global_batch <= n); keeping the last two
        # permutations avoids redrawing them every step. Only a cache: never state.
        self._perms: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return (f"Batches({self.stream.name!r}, seq_len={self.seq_len}, "
                f"global_batch={self.global_batch}, seed={self.seed}, n={self.n})")

    def epoch_of(self, step: int) -> int:
        """The epoch of the step's first window."""
        return (step * self.global_batch) // self.n

    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch``."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n)
            if len(self._perms) >= 2:
                del self._perms[max(self._perms, key=lambda e: abs(e - epoch))]
            self._perms[epoch] = perm
        return perm

    def indices(self, step: int) -> np.ndarray:
        """The window ids of ``step``, in batch order."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise DataError(f"{self.stream.name}: step must be a non-negative integer, got {step!r}")
        first = int(step) * self.global_batch
        out = np.empty(self.global_batch, dtype=np.int64)
        done = 0
        while done < self.global_batch:
            epoch, offset = divmod(first + done, self.n)
            take = min(self.global_batch - done, self.n - offset)
            out[done:done + take] = self.permutation(epoch)[offset:offset + take]
            done += take
        return out

    def windows(self, step: int) -> torch.Tensor:
        """The step's global batch: int64 ``[global_batch, seq_len + 1]``; inputs are
        ``[:, :-1]``, labels ``[:, 1:]``."""
        return _read_windows(self.stream, self.seq_len, self.indices(step))

    def state(self, cache_dir: str | None = None) -> dict:
        """What a checkpoint stores to check that a resume draws the same batches (``cache_dir``:
        where the stream's content hash is cached, ``TokenStream.fingerprint``)."""
        return {"format": _SAMPLER_FORMAT, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "n_windows": self.n,
                "stream": self.stream.fingerprint(cache_dir), "stream_name": self.stream.name}

    def check_state(self, saved: dict, cache_dir: str | None = None) -> None:
        """DataError naming each setting that differs from ``saved`` (a ``state()``).

        The stream's name is not compared: the same corpus may sit elsewhere on resume."""
        now = self.state(cache_dir)
        where = f"{self.stream.name}: resumed data does not match the checkpoint's"
        if not isinstance(saved, dict):
            raise DataError(f"{where}: the saved data state is {type(saved).__name__}, not a dict")
        if saved.get("kind") == "mixture":
            n = len(saved["corpora"]) if isinstance(saved.get("corpora"), list) else "several"
            raise DataError(f"{where}: the checkpoint was trained on a mixture of {n} corpora (data.mix), this run "
                            f"on one (data.train)")
        missing = [k for k in now if k != "stream_name" and k not in saved]
        if missing:
            raise DataError(f"{where}: the saved data state lacks {missing}")
        diffs = []
        for key in ("format", "seed", "seq_len", "global_batch", "n_windows"):
            if saved[key] != now[key]:
                diffs.append(f"{key} was {saved[key]!r}, is {now[key]!r}")
        old, new = saved["stream"], now["stream"]
        if not isinstance(old, dict) or old.get("length") != new["length"]:
            length = old.get("length") if isinstance(old, dict) else old
            diffs.append(f"stream length was {length!r} tokens, is {new['length']}")
        elif old.get("sha256") != new["sha256"]:
            diffs.append("stream content differs (hash of its first and last 4096 tokens)")
        elif "content_sha256" not in old:
            warnings.warn(f"{self.stream.name}: the checkpoint's data fingerprint predates content_sha256: only the "
                          f"length and the first and last 4096 tokens were compared, so an edit elsewhere in the "
                          f"corpus would go unnoticed", stacklevel=2)
        elif old["content_sha256"] != new["content_sha256"]:
            diffs.append("stream content differs (hash of every token): the corpus was edited since the checkpoint")
        if diffs:
            was = saved.get("stream_name")
            tail = f" (saved from {was})" if was and was != self.stream.name else ""
            raise DataError(f"{where}{tail}: " + "; ".join(diffs))


def eval_windows(stream: TokenStream, seq_len: int, global_batch: int, batches: int) -> list[torch.Tensor]:
    """A fixed evaluation set: the first ``batches * global_batch`` windows of ``stream``,
    in order, as ``batches`` tensors ``[global_batch, seq_len + 1]``.

    A stream too short for ``batches`` gives as many whole batches as fit, with a warning;
    one too short for a single batch is a DataError."""
    seq_len = positive_int(seq_len, "seq_len", stream.name)
    global_batch = positive_int(global_batch, "global_batch", stream.name)
    batches = positive_int(batches, "eval batches", stream.name)
    n = num_windows(stream, seq_len)
    if n < global_batch:
        raise _too_few(stream, seq_len, n, global_batch)
    fit = min(batches, n // global_batch)
    if fit < batches:
        warnings.warn(f"{stream.name}: {n} windows hold {fit} eval batches of {global_batch}, "
                      f"not the {batches} asked for; evaluating on {fit}", stacklevel=2)
    return [_read_windows(stream, seq_len, range(b * global_batch, (b + 1) * global_batch))
            for b in range(fit)]
