"""Sharded checkpoints: one safetensors file per (pp, tp) shard plus a JSON index.

* **Sharded**: each rank of data-parallel replica 0 (and context-parallel rank 0:
  the cp ranks of a (pp, tp) place hold the same parameters) writes the parameters (and
  AdamW moments) it holds, as they are, with how they are split recorded in the
  file's metadata. Under ``dp_shard`` every rank of the first sharding group writes its
  own flat ranges (``io.flat_pieces``). Nothing is gathered on one rank.
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

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from fxmegatron.errors import CheckpointError
from fxmegatron.io.checkpoint_reader import FORMAT, CheckpointReader
from fxmegatron.io.flat_pieces import flat_meta, optimizer_ranges, param_ranges, shard_group
from fxmegatron.placement import Placements, layout_to_json
from fxmegatron.ops.dropout import DropoutRng

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


def _rank_tensors(pm, optimizer, lead: bool, experts: bool = False):
    """The tensors this rank writes, by key, and their metadata: its flat ranges of sharded ones;
    the whole ones too where ``lead``; its experts' where ``experts`` (expert parallelism: each
    rank of the first ep group writes its own)."""
    tensors, meta = {}, {}
    coords = pm.program.coords()
    held = set(pm.program.experts) if experts else set()

    def put(key, t, m, rng=None, local=None):
        if rng is None:
            tensors[key], meta[key] = t.detach().contiguous().cpu(), m
        elif rng[1] > rng[0]:
            if key in tensors:
                raise CheckpointError(f"{key}: this rank holds two ranges of it; one is expected")
            tensors[key], meta[key] = t.detach().contiguous().cpu(), flat_meta(m, rng[0], rng[1], local)

    base, ranges = {}, {}
    for name, p in pm.named_parameters():
        base[name] = _piece_meta(pm.program.param_layout(name), coords, pm.program.global_params[name][0])
        ranges[name] = list(param_ranges(pm, name, p))
        for a, b, t in ranges[name]:
            put("model/" + name, t, base[name], (a, b), pm.program.dp_shards[name])
        if not ranges[name] and (lead or name in held):
            put("model/" + name, p, base[name])
    if optimizer is None:
        return tensors, meta
    names = _names(pm, optimizer)
    if hasattr(optimizer, "segments"):         # ShardedAdamW: its segments of whole parameters
        held = optimizer_ranges(optimizer)
        step = torch.tensor(float(optimizer.steps_taken))
        for g in optimizer.param_groups:
            for p in g["params"]:
                name = names[id(p)]
                if lead:
                    put(f"optim/{name}/step", step.clone(), _piece_meta(Placements(), {}, ()))
                for field, rs in held.get(id(p), {}).items():
                    for a, b, t in rs:
                        put(f"optim/{name}/{field}", t, base[name], (a, b), tuple(p.shape))
        return tensors, meta
    for p, st in optimizer.state.items():
        name = names[id(p)]
        for k, v in st.items():
            if not torch.is_tensor(v):
                raise CheckpointError(f"optimizer state {name}.{k} is a {type(v).__name__}, not a tensor")
            key = f"optim/{name}/{k}"
            if v.shape == p.shape and ranges[name]:
                for a, b, _ in ranges[name]:
                    put(key, v.reshape(-1)[:b - a], base[name], (a, b), pm.program.dp_shards[name])
            elif lead or (name in held and v.shape == p.shape):
                put(key, v, base[name] if v.shape == p.shape else _piece_meta(Placements(), {}, v.shape))
    return tensors, meta


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
    # under dp_shard each rank of the first replica group writes the flat ranges it holds
    # (io.flat_pieces); what every rank of the group holds whole, its rank 0 alone
    group, first_replica = shard_group(pm)
    sharded = pm.dp_shard != "none"
    lead = first_replica and group.rank == 0
    # expert parallelism: the ranks of the first ep group (dp ranks 0..ep-1) write their experts
    ep = pm.program.axes.get("ep")
    experts = ep is not None and ep.size > 1 and pm.program.axes["edp"].rank == 0 and first_replica \
        and pm.program.axes["cp"].rank == 0
    if (sharded and first_replica) or lead or experts:
        tensors, meta = _rank_tensors(pm, optimizer, lead, experts)
        # one file per writer: named by every axis that tells writers apart (dp and cp do not; under
        # dp_shard, the rank's place in its sharding group does; under ep, its ep rank)
        who = "-".join(f"{a}{r}" for a, r in sorted(coords.items()) if a not in ("dp", "cp"))
        who += f"-shard{group.rank}" if sharded else ""
        who += f"-ep{ep.rank}" if experts else ""
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


def _param_state(rd, pm, name: str, p, keys) -> dict:
    """Parameter ``name``'s optimizer state as this rank holds it, read from the checkpoint."""
    st = {}
    for key in keys:
        m = next(iter(rd.pieces[key].values()))[1]
        t = pm.shard_local(name, rd.local(key, pm, name)) \
            if m["shape"] == list(pm.program.global_params[name][0]) and p.dim() > 0 else rd.full(key)
        st[key.rsplit("/", 1)[1]] = t.to(p.device)
    return st


class _OnDemand(Mapping):
    """{index: state}, each read when it is looked up (an optimizer's ``load_state_dict`` takes
    one parameter's at a time), so no rank holds every parameter's whole state at once."""

    def __init__(self, read: Dict[int, Callable[[], dict]]):
        self._read = read

    def __getitem__(self, i):
        return self._read[i]()

    def __iter__(self):
        return iter(self._read)

    def __len__(self):
        return len(self._read)


def load(pm, optimizer, directory: str) -> dict:
    """Load a checkpoint saved at any (dp, pp, tp) into ``pm`` (and ``optimizer``);
    returns the ``extra`` dict given to ``save``."""
    rd = CheckpointReader(directory)
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
                keys = [k for k in rd.pieces if k.startswith(f"optim/{names[id(p)]}/")]
                if keys:
                    state[idx] = functools.partial(_param_state, rd, pm, names[id(p)], p, keys)
                ids.append(idx)
                idx += 1
            saved = rd.index["param_groups"][gi] if gi < len(rd.index["param_groups"]) else {}
            groups.append({**{k: v for k, v in g.items() if k != "params"}, **saved, "params": ids})
        # read as the optimizer asks for each parameter's state: one parameter's whole state at a time
        optimizer.load_state_dict({"state": _OnDemand(state), "param_groups": groups})
    step = rd.index.get("rng_step")
    if step is not None:
        for m in _rng_modules(pm):
            m.step = step
    return rd.index.get("extra", {})


def read_full_state(directory: str) -> Dict[str, torch.Tensor]:
    """Every parameter of a checkpoint saved at any (dp, pp, tp), whole, under the model's names
    (a tied weight once, under the name the capture kept; a weight that several pipeline ranks
    hold, such as a tied embedding and LM head, once). Optimizer state is left out."""
    rd = CheckpointReader(directory)
    return {key[len("model/"):]: rd.full(key) for key in sorted(rd.pieces) if key.startswith("model/")}


def read_extra(directory: str) -> dict:
    """The ``extra`` dict given to ``save``, without reading any tensor."""
    return CheckpointReader(directory).index.get("extra", {})
