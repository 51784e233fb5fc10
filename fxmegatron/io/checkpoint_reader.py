"""Reading a checkpoint written by ``io.checkpoint.save``: its index, each tensor's pieces across
the shard files (per mesh axis, and under ``dp_shard`` their flat ranges), the shard digests,
and each tensor put together whole (``full``) or cut for a loading rank (``local``)."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import warnings
from typing import Dict

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from fxmegatron.errors import CheckpointError
from fxmegatron.io.flat_pieces import join_flat
from fxmegatron.placement import join_layout, layout_from_json, take_layout

FORMAT = "fxmegatron-checkpoint/1"


def per_axis(m: dict) -> dict:
    """A piece's metadata in the per-axis form; checkpoints written before it recorded tp
    alone ({"placement", "tp_rank", "tp"})."""
    if "layout" in m:
        return m
    sharded = m["placement"] != "R"
    return {"layout": {"tp": m["placement"]} if sharded else {}, "coords": {"tp": m["tp_rank"]} if sharded else {},
            "degrees": {"tp": m["tp"]} if sharded else {}, "shape": m["shape"]}


class CheckpointReader:
    """Every saved piece of every tensor, read lazily from the safetensors files. A file's digest
    (``index["digests"]``) is checked the first time a tensor is read from it, so a rank hashes
    only the shards it loads from; checkpoints written before digests load unchecked, with a
    warning."""

    def __init__(self, directory: str):
        self.directory = directory
        path = os.path.join(directory, "index.json")
        if not os.path.exists(path):
            raise CheckpointError(f"{directory} has no index.json: not a checkpoint, or a save that did not "
                                  "finish (an unfinished save leaves only DIR.tmp)")
        try:
            with open(path) as f:
                self.index = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            got = self.index.get("format") if isinstance(self.index, dict) else self.index
            raise CheckpointError(f"{path}: format {got!r}, expected {FORMAT!r}")
        self.digests = self.index.get("digests")
        self._verified = set()
        self.pieces: Dict[str, Dict[int, tuple]] = {}
        for fname in self.index["files"]:
            fpath = os.path.join(directory, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"{directory}: {fname} is listed in index.json but missing")
            want = (self.digests or {}).get(fname)
            if want is not None and os.path.getsize(fpath) != want["bytes"]:
                raise CheckpointError(f"{fpath}: {os.path.getsize(fpath)} bytes, index.json says {want['bytes']}: "
                                      "a truncated or replaced shard")
            try:
                with safe_open(fpath, "pt") as f:
                    meta = json.loads(f.metadata()["fxmegatron"])
            except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
                self.verify(fpath)     # a corrupted file is named as such before its symptom
                raise CheckpointError(f"{fpath}: not a readable checkpoint shard ({type(exc).__name__}: "
                                      f"{exc})") from exc
            for key, m in meta.items():
                m = per_axis(m)
                at = tuple(m["coords"][a] for a in layout_from_json(m["layout"]).sharded())
                # a flat range of that piece (io.flat_pieces) is told apart by where it starts
                self.pieces.setdefault(key, {})[at + ((m["flat"][0],) if "flat" in m else ())] = (fpath, m)

    def verify(self, fpath: str) -> None:
        """CheckpointError when ``fpath``'s sha256 is not the one its index recorded."""
        if fpath in self._verified:
            return
        if self.digests is None:
            if not self._verified and (not dist.is_initialized() or dist.get_rank() == 0):
                warnings.warn(f"{os.path.join(self.directory, 'index.json')} has no shard digests (written "
                              "before fxmegatron recorded them): its shards load unverified", stacklevel=4)
            self._verified.add(fpath)
            return
        want = self.digests.get(os.path.basename(fpath))
        if want is None:
            raise CheckpointError(f"{fpath}: index.json records no digest for it, as it does for the other shards")
        with open(fpath, "rb") as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
        if got != want["sha256"]:
            raise CheckpointError(f"{fpath}: sha256 {got[:16]}..., index.json recorded {want['sha256'][:16]}...: "
                                  "the shard changed after it was saved (a corrupted disk or copy); restore it or "
                                  "resume from another checkpoint")
        self._verified.add(fpath)

    def verify_all(self) -> None:
        for fname in self.index["files"]:
            self.verify(os.path.join(self.directory, fname))

    def shape(self, key: str) -> list:
        return next(iter(self.pieces[key].values()))[1]["shape"]

    def _read(self, fpath: str, key: str) -> torch.Tensor:
        self.verify(fpath)
        try:
            with safe_open(fpath, "pt") as f:
                return f.get_tensor(key)
        except SafetensorError as exc:
            raise CheckpointError(f"{fpath}: cannot read {key} ({exc})") from exc

    def full(self, key: str) -> torch.Tensor:
        pieces = self.pieces[key]
        m0 = next(iter(pieces.values()))[1]
        layout, degrees = layout_from_json(m0["layout"]), m0["degrees"]     # degrees: the cutting axes
        n = len(layout.sharded())
        want = list(itertools.product(*(range(degrees[a]) for a in layout.sharded())))
        if sorted({at[:n] for at in pieces}) != want:
            raise CheckpointError(f"{self.directory}: {key}: pieces {sorted(pieces)} over "
                                  f"{', '.join(f'{a}={n}' for a, n in degrees.items())} in the checkpoint")
        parts = {}
        for at, (fpath, m) in pieces.items():
            if "flat" not in m:
                parts[at] = self._read(fpath, key)
        for at in want:
            if at not in parts:         # put together from its flat ranges
                ranges = [(m["flat"][0], m["flat"][1], self._read(fpath, key))
                          for a, (fpath, m) in pieces.items() if a[:n] == at and "flat" in m]
                local = next(m["local"] for a, (_, m) in pieces.items() if a[:n] == at and "flat" in m)
                parts[at] = join_flat(f"{self.directory}: {key} at {dict(zip(layout.sharded(), at))}", ranges, local)
        full = join_layout(parts, layout, degrees)
        if list(full.shape) != m0["shape"]:
            raise CheckpointError(f"{self.directory}: {key}: reassembled shape {list(full.shape)} != saved "
                                  f"{m0['shape']}")
        return full

    def local(self, key: str, pm, name: str) -> torch.Tensor:
        full = self.full(key)
        want = pm.program.global_params[name][0]
        if tuple(full.shape) != tuple(want):
            raise CheckpointError(f"{self.directory}: {key}: the checkpoint's shape {tuple(full.shape)} differs "
                                  f"from the model's {tuple(want)}")
        return take_layout(full, pm.program.param_layout(name), pm.program.coords())

    def check_model(self, pm) -> None:
        """CheckpointError, before anything is loaded, when the checkpoint's parameters are not the
        model's: one it lacks (of those this rank holds), one the model does not have, a shape."""
        saved = {k[len("model/"):] for k in self.pieces if k.startswith("model/")}
        model = pm.program.global_params
        missing = [n for n, _ in pm.named_parameters() if n not in saved]
        extra = sorted(saved - set(model))
        shapes = [(n, self.shape("model/" + n), list(model[n][0])) for n in model
                  if n in saved and self.shape("model/" + n) != list(model[n][0])]
        if not (missing or extra or shapes):
            return
        self.verify_all()      # a corrupted shard is named as such, not as another model
        what = []
        if missing:
            what.append(f"no parameter {missing[0]!r} ({len(missing)} missing)")
        if extra:
            what.append(f"parameter {extra[0]!r} that the model does not have ({len(extra)} such)")
        if shapes:
            n, was, now = shapes[0]
            what.append(f"{n!r} of shape {was}, the model's is {now} ({len(shapes)} such)")
        raise CheckpointError(f"{self.directory}: a checkpoint of another model: " + "; ".join(what))
