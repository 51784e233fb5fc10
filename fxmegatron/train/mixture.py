"""``data.mix``: a weighted mixture of training corpora, as Megatron's ``BlendedDataset``.

The global sequence of samples interleaves the corpora by Megatron's ``build_blending_indices``
(``megatron/core/datasets/helpers.cpp``): sample ``n`` (from 0) comes from the corpus with the
largest error ``weight_i * max(n, 1) - count_i`` (``count_i``: the samples corpus i gave before
n; ties to the lowest index), so after n samples every corpus has given about ``weight_i * n`` of
them: within 1/2 with two corpora; with more, Megatron's rule can stray a little past 1 (1.32 for
weights 3 : 1 : 0.001 : 7.5, tests/test_train_mixture.py). Corpus i's ``count_i``-th sample is
position ``count_i`` of its own endless sequence of epochs: a ``Batches`` of one window a step
over that corpus, seeded from (run.seed, i). The batch of step k is samples
``[k * global_batch, (k + 1) * global_batch)``: a function of (seed, k) only, as a single
corpus's is. The blending is replayed from sample 0 (from the last of every 4096th sample's
counts already computed), about 0.5 s per million samples, once per process on a resume."""
from __future__ import annotations

import math
import warnings
from typing import Callable, List, Sequence

import numpy as np
import torch

from fxmegatron.errors import ConfigError, DataError
from fxmegatron.train.data import Batches, positive_int, num_windows
from fxmegatron.train.tokens import TokenStream

# Bumped when the batches drawn for the same (corpora, weights, seed, step) would change.
_MIX_FORMAT = 1
# The blending is sequential (each pick depends on all before it): the counts are kept every
# _MEMO samples so that a step computed out of order replays at most _MEMO picks.
_MEMO = 4096


def check_mix(entries: list, where: str, resolve: Callable[[str], str]) -> List[dict]:
    """The ``data.mix`` tables checked: each ``{path, weight}``, the weight a positive finite
    number; ``resolve`` makes the path absolute. A ConfigError names the entry."""
    out = []
    for i, e in enumerate(entries):
        at = f"{where}: data.mix[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{at} = {e!r} must be a table {{path = \"...\", weight = 0.5}}")
        unknown = sorted(set(e) - {"path", "weight"})
        if unknown:
            raise ConfigError(f"{at}: unknown key(s) {unknown}; an entry has path and weight")
        if "weight" not in e or "path" not in e:
            raise ConfigError(f"{at} has no {'weight' if 'path' in e else 'path'} (an entry is {{path, weight}})")
        path, w = e["path"], e["weight"]
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{at}.path must be a non-empty string, got {path!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{at}.weight = {w!r} must be a positive number (the weights are normalised "
                              "to sum to 1)")
        out.append({"path": resolve(path), "weight": float(w)})
    return out


def normalised(weights: Sequence[float], names: Sequence[str]) -> List[float]:
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float, np.floating)) or not math.isfinite(w) or w <= 0:
            raise DataError(f"{names[i]}: mixture weight {w!r} must be a positive number")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def blend(weights: Sequence[float], counts: List[int], start: int, count: int) -> List[int]:
    """The corpus of samples ``[start, start + count)`` given ``counts`` (each corpus's samples
    before ``start``), which are advanced in place. Megatron's rule, float for float."""
    picks = []
    k = len(weights)
    for n in range(start, start + count):
        x = float(max(n, 1))
        best, err = 0, weights[0] * x - counts[0]
        for i in range(1, k):
            e = weights[i] * x - counts[i]
            if e > err:
                best, err = i, e
        counts[best] += 1
        picks.append(best)
    return picks


def _corpus_seed(seed: int, i: int) -> int:
    # SeedSequence mixes (seed, i) into unrelated streams: corpus 1 of seed s is not corpus 0 of s + 1.
    return int(np.random.SeedSequence([seed, i]).generate_state(1, np.uint64)[0])


class Mixture:
    """The training batches of a weighted mixture of ``corpora`` (see the module's docstring);
    the interface of ``Batches``: ``windows(step)``, ``state()``, ``check_state()``."""

    def __init__(self, corpora: Sequence[TokenStream], weights: Sequence[float], seq_len: int, global_batch: int,
                 seed: int):
        if not corpora or len(corpora) != len(weights):
            raise DataError(f"a mixture needs one weight per corpus, got {len(corpora)} corpora and "
                            f"{len(weights)} weights")
        self.corpora = list(corpora)
        self.names = [s.name for s in self.corpora]
        self.given_weights = [float(w) for w in weights]
        self.weights = normalised(weights, self.names)
        self.seq_len = positive_int(seq_len, "seq_len", self.names[0])
        self.global_batch = positive_int(global_batch, "global_batch", self.names[0])
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"{self.names[0]}: seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self.samplers = [Batches(s, self.seq_len, 1, _corpus_seed(self.seed, i)) for i, s in enumerate(self.corpora)]
        self.n = sum(b.n for b in self.samplers)
        self._memo = {0: [0] * len(self.corpora)}     # sample (a multiple of _MEMO) -> counts there
        self._cursor = (0, [0] * len(self.corpora))   # where the last step ended: sequential steps replay nothing

    def __repr__(self) -> str:
        parts = ", ".join(f"{n!r}: {w:.4g}" for n, w in zip(self.names, self.weights))
        return f"Mixture({{{parts}}}, seq_len={self.seq_len}, global_batch={self.global_batch}, seed={self.seed})"

    def _counts_at(self, sample: int) -> List[int]:
        at, counts = self._cursor
        if not at <= sample < at + _MEMO:
            base = sample - sample % _MEMO
            known = max(m for m in self._memo if m <= base)
            counts = list(self._memo[known])
            while known < base:
                blend(self.weights, counts, known, _MEMO)
                known += _MEMO
                self._memo[known] = list(counts)
            at = base
        counts = list(counts)
        blend(self.weights, counts, at, sample - at)
        return counts

    def picks(self, step: int) -> np.ndarray:
        """int64 ``[global_batch, 2]``: each sample's corpus and window id in that corpus."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise DataError(f"{self.names[0]}: step must be a non-negative integer, got {step!r}")
        first = int(step) * self.global_batch
        counts = self._counts_at(first)
        position = list(counts)     # each corpus's next position in its own epochs
        out = np.empty((self.global_batch, 2), dtype=np.int64)
        for r, c in enumerate(blend(self.weights, counts, first, self.global_batch)):
            out[r] = c, self.samplers[c].indices(position[c])[0]
            position[c] += 1
        self._cursor = (first + self.global_batch, counts)
        return out

    def windows(self, step: int) -> torch.Tensor:
        """The step's global batch: int64 ``[global_batch, seq_len + 1]``, as ``Batches.windows``."""
        rows = np.empty((self.global_batch, self.seq_len + 1), dtype=np.int64)
        for r, (c, w) in enumerate(self.picks(step).tolist()):
            rows[r] = self.corpora[c].read(w * self.seq_len, self.seq_len + 1)
        return torch.from_numpy(rows)

    def state(self, cache_dir: str | None = None) -> dict:
        """What a checkpoint stores: the settings and, per corpus, its weights (as given and
        normalised) and its sampler's state (its stream's fingerprint among them)."""
        return {"format": _MIX_FORMAT, "kind": "mixture", "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch,
                "corpora": [{"weight": w, "given_weight": g, "sampler": b.state(cache_dir)}
                            for w, g, b in zip(self.weights, self.given_weights, self.samplers)]}

    def check_state(self, saved: dict, cache_dir: str | None = None) -> None:
        """DataError naming each setting, weight or corpus that differs from ``saved``."""
        where = "data.mix: resumed data does not match the checkpoint's"
        if not isinstance(saved, dict):
            raise DataError(f"{where}: the saved data state is {type(saved).__name__}, not a dict")
        if saved.get("kind") != "mixture" or not isinstance(saved.get("corpora"), list):
            was = saved.get("stream_name", "?")
            raise DataError(f"{where}: the checkpoint was trained on one corpus (data.train: {was}), this run "
                            f"mixes {len(self.corpora)} (data.mix)")
        diffs = [f"{k} was {saved.get(k)!r}, is {getattr(self, k)!r}"
                 for k in ("seed", "seq_len", "global_batch") if saved.get(k) != getattr(self, k)]
        if saved.get("format") != _MIX_FORMAT:
            diffs.append(f"mixture format was {saved.get('format')!r}, is {_MIX_FORMAT}")
        old = saved["corpora"]
        if len(old) != len(self.corpora):
            names = [c.get("sampler", {}).get("stream_name", "?") if isinstance(c, dict) else "?" for c in old]
            diffs.append(f"it mixed {len(old)} corpora {names}, this run {len(self.corpora)} {self.names}")
        else:
            for i, (o, sampler) in enumerate(zip(old, self.samplers)):
                at = f"data.mix[{i}] ({self.names[i]})"
                if not isinstance(o, dict) or "weight" not in o or "sampler" not in o:
                    diffs.append(f"{at}: the saved entry {o!r} is not a mixture corpus's state")
                    continue
                if o["weight"] != self.weights[i]:
                    diffs.append(f"{at}: weight was {o.get('given_weight')!r} ({o['weight']:.6g} normalised), is "
                                 f"{self.given_weights[i]!r} ({self.weights[i]:.6g} normalised)")
                try:
                    sampler.check_state(o["sampler"], cache_dir)
                except DataError as e:
                    diffs.append(f"{at}: {e}")
        if diffs:
            raise DataError(f"{where}: " + "; ".join(diffs))


def eval_mix_windows(valids: Sequence[TokenStream], weights: Sequence[float], seq_len: int, global_batch: int,
                     batches: int) -> List[torch.Tensor]:
    """The held-out set of a mixture without data.valid: ``batches`` global batches whose samples
    come from the corpora's held-out tails by the training mixture's blending, corpus i's k-th
    sample being window k of its tail, in order (``eval_windows`` of each tail). Fewer batches,
    with a warning, when a tail runs out; a DataError when not even one fits."""
    names = [v.name for v in valids]
    w = normalised(weights, names)
    batches = positive_int(batches, "eval batches", names[0])
    have = [num_windows(v, seq_len) for v in valids]
    fit = batches
    while fit:
        counts = [0] * len(valids)
        picks = blend(w, counts, 0, fit * global_batch)
        short = [i for i, c in enumerate(counts) if c > have[i]]
        if not short:
            break
        fit -= 1
    if not fit:
        i = short[0]
        raise DataError(f"{names[i]}: its {have[i]} held-out windows of seq_len+1 = {seq_len + 1} tokens are fewer "
                        f"than the {counts[i]} that one held-out batch of the mixture takes from it; give more data, "
                        f"a larger data.valid_fraction, or data.valid")
    if fit < batches:
        warnings.warn(f"data.mix: the corpora's held-out tails hold {fit} eval batches of {global_batch}, not the "
                      f"{batches} asked for; evaluating on {fit}", stacklevel=2)
    rows = np.empty((fit * global_batch, seq_len + 1), dtype=np.int64)
    taken = [0] * len(valids)
    for r, c in enumerate(picks):
        rows[r] = valids[c].read(taken[c] * seq_len, seq_len + 1)
        taken[c] += 1
    out = torch.from_numpy(rows)
    return [out[b * global_batch:(b + 1) * global_batch] for b in range(fit)]
