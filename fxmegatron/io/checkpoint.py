"""Sharded checkpoints: one safetensors file per (pp, tp) shard plus a JSON index.

* **Sharded**: each rank of data-parallel replica 0 (and context-parallel rank 0:
  the cp ranks of a (pp, tp) place hold the same parameters) writes the parameters (and
  AdamW moments) it holds, as they are, with how they are split recorded in the
  file's metadata. Nothing is gathered on one rank.
* **Atomic**: files go to ``DIR.tmp``. ``index.json`` is written last, and the
  folder is then renamed to ``DIR``. A folder without an index is never loaded,
  so a save that dies half-way cannot be taken for a complete one.
* **Reshardable**: each piece records its layout per mesh axis, the writer's coordinate and
  the degree on every axis that cuts it; a tensor is reassembled from the pieces
  (``join_layout``) and cut for the loading layout (``take_layout``), so a checkpoint saved
  at one (dp, pp, cp, tp) loads at another. Pieces written before the per-axis form (tp's
  placement, ``tp_rank``, ``tp``) are read as tp's layout.
* **No pickles**: safetensors and JSON only; loading executes no stored code.
* **Checked**: ``index.json`` records each shard's sha256 and size, checked when a rank first
  reads from the shard; the checkpoint's parameters are compared with the model's (names and
  shapes) before anything is loaded. A checkpoint without digests (written before they were
  recorded) loads unverified, with a warning.

Why not ``torch.distributed.checkpoint``: its metadata file is a pickle, and
its resharding works on DTensors, which cannot express the block-wise split of
a fused QKV weight (``Shard(dim, blocks)``). The on-disk layout here is what
``safetensors`` gives any reader.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fxmegatron.errors import CheckpointError
from fxmegatron.placement import Placements, join_layout, layout_from_json, layout_to_json, take_layout
from fxmegatron.ops.dropout import DropoutRng

FORMAT = "fxmegatron-checkpoint/1"
# A shard's digest between its write and the index; none is left in a complete checkpoint.
DIGEST_SUFFIX = ".digest.json"



def _digest(path: str) -> dict:
    """sha256 and size of a file, flushed to disk first: the index that lists it comes after."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        return {"sha256": hashlib.file_digest(f, "sha256").hexdigest(), "bytes": os.fstat(f.fileno()).st_size}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _names(pm, optimizer) -> Dict[int, str]:
    by_id = {id(p): n for n, p in pm.named_parameters()}
    if optimizer is None:
        return {}
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in by_id:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of the parallel model; "
                                      "build it from pm.parameters()")
            out[id(p)] = by_id[id(p)]
    return out


def _rng_modules(pm) -> List[DropoutRng]:
    return [m for m in pm.modules() if isinstance(m, DropoutRng)]


def _piece_meta(layout: Placements, coords, shape) -> dict:
    """What a shard records of one tensor it holds: its layout per mesh axis, this rank's
    coordinate and the degree on each axis that cuts it, the whole tensor's shape."""
    axes = layout.sharded()
    return {"layout": layout_to_json(layout), "coords": {a: coords.get(a, (0, 1))[0] for a in axes},
            "degrees": {a: coords.get(a, (0, 1))[1] for a in axes}, "shape": list(shape)}


def _per_axis(m: dict) -> dict:
    """A piece's metadata in the per-axis form; checkpoints written before it recorded tp
    alone ({"placement", "tp_rank", "tp"})."""
    if "layout" in m:
        return m
    sharded = m["placement"] != "R"
    return {"layout": {"tp": m["placement"]} if sharded else {}, "coords": {"tp": m["tp_rank"]} if sharded else {},
            "degrees": {"tp": m["tp"]} if sharded else {}, "shape": m["shape"]}


def save(pm, optimizer, directory: str, extra: Optional[dict] = None,
         write_files: Optional[Callable[[str], None]] = None) -> None:
    """Save ``pm``'s parameters and ``optimizer``'s state (collective: every rank calls it).
    ``write_files(folder)``, on rank 0, adds files of its own (a tokenizer) before the index, so
    that a complete checkpoint always has them."""
    tmp = directory.rstrip("/") + ".tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    coords = pm.coords()
    # a sharded optimizer (dp_shard) assembles each parameter's whole state from every rank's share:
    # collective, so every rank asks before the writers write
    states = optimizer.full_state() if hasattr(optimizer, "full_state") else \
        (optimizer.state if optimizer is not None else {})
    # dp_shard="full": each parameter and its state put together from the dp shards (collective too)
    names = _names(pm, optimizer)
    local = {name: pm.whole_local(name, p) for name, p in pm.named_parameters()}
    states = {p: {k: pm.whole_local(names[id(p)], v) if torch.is_tensor(v) else v for k, v in st.items()}
              for p, st in states.items()}
    if coords["dp"] == 0 and coords["cp"] == 0:
        tensors, meta = {}, {}
        for name, p in pm.named_parameters():
            key = "model/" + name
            tensors[key] = local[name].detach().contiguous().cpu()
            meta[key] = _piece_meta(pm.program.param_layout(name), pm.program.coords(),
                                    pm.program.global_params[name][0])
        for p, st in states.items():
            name = names[id(p)]
            for k, v in st.items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {name}.{k} is a {type(v).__name__}, not a tensor")
                key = f"optim/{name}/{k}"
                tensors[key] = v.detach().contiguous().cpu()
                if v.shape == local[name].shape:
                    meta[key] = dict(meta["model/" + name])
                else:
                    meta[key] = _piece_meta(Placements(), {}, v.shape)
        # one file per writer: named by every axis that tells writers apart (dp and cp do not)
        who = "-".join(f"{a}{r}" for a, r in sorted(coords.items()) if a not in ("dp", "cp"))
        shard = f"{tmp}/shard-{who}.safetensors"
        save_file(tensors, shard, metadata={"fxmegatron": json.dumps(meta)})
        # Each writer hashes its own shard (no rank reads the whole checkpoint) and leaves the
        # digest beside it for rank 0's index: files, as the shards are, so no new collective.
        with open(shard + DIGEST_SUFFIX, "w") as f:
            json.dump(_digest(shard), f)
    _barrier()
    if _rank() == 0:
        if write_files is not None:
            write_files(tmp)
        files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        digests = {}
        for fname in files:
            with open(os.path.join(tmp, fname + DIGEST_SUFFIX)) as f:
                digests[fname] = json.load(f)
            os.remove(os.path.join(tmp, fname + DIGEST_SUFFIX))
        rng = _rng_modules(pm)
        groups = []
        for g in (optimizer.param_groups if optimizer is not None else ()):
            groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"})
        index = {"format": FORMAT,
                 "layout": {a: n for a, n in pm.degrees().items() if a != "cp" or n > 1},
                 "files": files,
                 "digests": digests,
                 "param_groups": groups,
                 "rng_step": rng[0].step if rng else None,
                 "extra": extra or {}}
        with open(f"{tmp}/index.json.part", "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f"{tmp}/index.json.part", f"{tmp}/index.json")
        old = directory.rstrip("/") + ".old"
        if os.path.exists(directory):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


class _Reader:
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
                m = _per_axis(m)
                at = tuple(m["coords"][a] for a in layout_from_json(m["layout"]).sharded())
                self.pieces.setdefault(key, {})[at] = (fpath, m)

    def verify(self, fpath: str) -> None:
        """CheckpointError when ``fpath``'s sha256 is not the one its index recorded."""
        if fpath in self._verified:
            return
        if self.digests is None:
            if not self._verified and _rank() == 0:
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

    def full(self, key: str) -> torch.Tensor:
        pieces = self.pieces[key]
        m0 = next(iter(pieces.values()))[1]
        layout, degrees = layout_from_json(m0["layout"]), m0["degrees"]     # degrees: the cutting axes
        want = list(itertools.product(*(range(degrees[a]) for a in layout.sharded())))
        if sorted(pieces) != want:
            raise CheckpointError(f"{self.directory}: {key}: pieces {sorted(pieces)} over "
                                  f"{', '.join(f'{a}={n}' for a, n in degrees.items())} in the checkpoint")
        parts = {}
        for at in want:
            fpath, _ = pieces[at]
            self.verify(fpath)
            try:
                with safe_open(fpath, "pt") as f:
                    parts[at] = f.get_tensor(key)
            except SafetensorError as exc:
                raise CheckpointError(f"{fpath}: cannot read {key} ({exc})") from exc
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


def load(pm, optimizer, directory: str) -> dict:
    """Load a checkpoint saved at any (dp, pp, tp) into ``pm`` (and ``optimizer``);
    returns the ``extra`` dict given to ``save``."""
    rd = _Reader(directory)
    rd.check_model(pm)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            p.copy_(pm.shard_local(name, rd.local("model/" + name, pm, name)))
    if optimizer is not None:
        names = _names(pm, optimizer)
        state = {}
        idx = 0
        groups = []
        for gi, g in enumerate(optimizer.param_groups):
            ids = []
            for p in g["params"]:
                name = names[id(p)]
                st = {}
                for key in [k for k in rd.pieces if k.startswith(f"optim/{name}/")]:
                    field = key.rsplit("/", 1)[1]
                    m = next(iter(rd.pieces[key].values()))[1]
                    t = pm.shard_local(name, rd.local(key, pm, name)) \
                        if m["shape"] == list(pm.program.global_params[name][0]) and p.dim() > 0 else rd.full(key)
                    st[field] = t.to(p.device)
                if st:
                    state[idx] = st
                ids.append(idx)
                idx += 1
            saved = rd.index["param_groups"][gi] if gi < len(rd.index["param_groups"]) else {}
            groups.append({**{k: v for k, v in g.items() if k != "params"}, **saved, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    step = rd.index.get("rng_step")
    if step is not None:
        for m in _rng_modules(pm):
            m.step = step
    return rd.index.get("extra", {})


def read_full_state(directory: str) -> Dict[str, torch.Tensor]:
    """Every parameter of a checkpoint saved at any (dp, pp, tp), whole, under the model's names
    (a tied weight once, under the name the capture kept; a weight that several pipeline ranks
    hold, such as a tied embedding and LM head, once). Optimizer state is left out."""
    rd = _Reader(directory)
    return {key[len("model/"):]: rd.full(key) for key in sorted(rd.pieces) if key.startswith("model/")}


def read_extra(directory: str) -> dict:
    """The ``extra`` dict given to ``save``, without reading any tensor."""
    return _Reader(directory).index.get("extra", {})
