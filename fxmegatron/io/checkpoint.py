"""Sharded checkpoints: one safetensors file per (pp, tp) shard plus a JSON index.

* **Sharded**: each rank of data-parallel replica 0 (and context-parallel rank 0:
  the cp ranks of a (pp, tp) place hold the same parameters) writes the parameters (and
  AdamW moments) it holds, as they are, with how they are split recorded in the
  file's metadata. Nothing is gathered on one rank.
* **Atomic**: files go to ``DIR.tmp``. ``index.json`` is written last, and the
  folder is then renamed to ``DIR``. A folder without an index is never loaded,
  so a save that dies half-way cannot be taken for a complete one.
* **Reshardable**: a tensor is reassembled from the saved tp pieces (``join_shards``)
  and cut for the loading layout (``take_shard``), so a checkpoint saved at one
  (dp, pp, tp) loads at another.
* **No pickles**: safetensors and JSON only; loading executes no stored code.

Why not ``torch.distributed.checkpoint``: its metadata file is a pickle, and
its resharding works on DTensors, which cannot express the block-wise split of
a fused QKV weight (``Shard(dim, blocks)``). The on-disk layout here is what
``safetensors`` gives any reader.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from fxmegatron.errors import CheckpointError
from fxmegatron.placement import join_shards, placement_from_json, placement_to_json, take_shard
from fxmegatron.ops.dropout import DropoutRng

FORMAT = "fxmegatron-checkpoint/1"



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
    if pm.dp_rank == 0 and getattr(pm, "cp_rank", 0) == 0:
        tensors, meta = {}, {}
        for name, p in pm.named_parameters():
            key = "model/" + name
            tensors[key] = p.detach().contiguous().cpu()
            meta[key] = {"placement": placement_to_json(pm.placement(name)), "tp_rank": pm.tp_rank,
                         "tp": pm.tp_size, "shape": list(pm.program.global_params[name][0])}
        names = _names(pm, optimizer)
        for p, st in (optimizer.state.items() if optimizer is not None else ()):
            name = names[id(p)]
            for k, v in st.items():
                if not torch.is_tensor(v):
                    raise CheckpointError(f"optimizer state {name}.{k} is a {type(v).__name__}, not a tensor")
                key = f"optim/{name}/{k}"
                tensors[key] = v.detach().contiguous().cpu()
                if v.shape == p.shape:
                    meta[key] = dict(meta["model/" + name])
                else:
                    meta[key] = {"placement": "R", "tp_rank": 0, "tp": 1, "shape": list(v.shape)}
        save_file(tensors, f"{tmp}/shard-pp{pm.pp_rank}-tp{pm.tp_rank}.safetensors",
                  metadata={"fxmegatron": json.dumps(meta)})
    _barrier()
    if _rank() == 0:
        if write_files is not None:
            write_files(tmp)
        rng = _rng_modules(pm)
        groups = []
        for g in (optimizer.param_groups if optimizer is not None else ()):
            groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"})
        index = {"format": FORMAT,
                 "layout": {"dp": pm.dp_size, "pp": pm.pp_size, "tp": pm.tp_size,
                            **({"cp": pm.cp_size} if getattr(pm, "cp_size", 1) > 1 else {})},
                 "files": sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors")),
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
    """Every saved piece of every tensor, read lazily from the safetensors files."""

    def __init__(self, directory: str):
        path = os.path.join(directory, "index.json")
        if not os.path.exists(path):
            raise CheckpointError(f"{directory} has no index.json: not a checkpoint, or a save that did not "
                                  "finish (an unfinished save leaves only DIR.tmp)")
        with open(path) as f:
            self.index = json.load(f)
        if self.index.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        self.pieces: Dict[str, Dict[int, tuple]] = {}
        for fname in self.index["files"]:
            fpath = os.path.join(directory, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"{directory}: {fname} is listed in index.json but missing")
            with safe_open(fpath, "pt") as f:
                meta = json.loads(f.metadata()["fxmegatron"])
            for key, m in meta.items():
                self.pieces.setdefault(key, {})[m["tp_rank"]] = (fpath, m)

    def has(self, key: str) -> bool:
        return key in self.pieces

    def full(self, key: str) -> torch.Tensor:
        pieces = self.pieces[key]
        m0 = next(iter(pieces.values()))[1]
        tp = m0["tp"]
        if sorted(pieces) != list(range(tp)):
            raise CheckpointError(f"{key}: pieces {sorted(pieces)} of tp={tp} in the checkpoint")
        parts = []
        for r in range(tp):
            fpath, _ = pieces[r]
            with safe_open(fpath, "pt") as f:
                parts.append(f.get_tensor(key))
        full = join_shards(parts, placement_from_json(m0["placement"]))
        if list(full.shape) != m0["shape"]:
            raise CheckpointError(f"{key}: reassembled shape {list(full.shape)} != saved {m0['shape']}")
        return full

    def local(self, key: str, pm, name: str) -> torch.Tensor:
        full = self.full(key)
        want = pm.program.global_params[name][0]
        if tuple(full.shape) != tuple(want):
            raise CheckpointError(f"{key}: the checkpoint's shape {tuple(full.shape)} differs from the model's "
                                  f"{tuple(want)}")
        return take_shard(full, pm.placement(name), pm.tp_rank, pm.tp_size)


def load(pm, optimizer, directory: str) -> dict:
    """Load a checkpoint saved at any (dp, pp, tp) into ``pm`` (and ``optimizer``);
    returns the ``extra`` dict given to ``save``."""
    rd = _Reader(directory)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            key = "model/" + name
            if not rd.has(key):
                raise CheckpointError(f"{directory}: no parameter {name!r} in the checkpoint")
            p.copy_(rd.local(key, pm, name))
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
                    t = rd.local(key, pm, name) if m["shape"] == list(pm.program.global_params[name][0]) and p.dim() > 0 \
                        else rd.full(key)
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
