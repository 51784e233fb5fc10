"""Where the trainer's model comes from: ``load_model(kind, path, options, dtype)``.

* ``"gpt"``: the bundled GPT (``fxmegatron.models.gpt``), ``options`` its ``GPTConfig``
  fields. Built on the meta device with no weights: ``parallelize`` then initialises each
  rank's shards directly (``fxmegatron.lower.materialize.init_shard``). That draws from the
  same distributions as ``GPT._init`` (N(0, 0.02) for the embeddings and linear weights, zeros
  for biases, ones for LayerNorm weights) but not the same numbers as ``GPT(cfg)`` under
  ``torch.manual_seed``: each value is keyed by (seed, name, row chunk), so that every layout
  gets the same model. With ``path`` (a folder written by ``fxmegatron export`` from a GPT
  checkpoint), its config.json gives the fields and model.safetensors the weights.
* ``"hf"``: a folder written by ``save_pretrained`` (config.json and model.safetensors, or
  model-*.safetensors with model.safetensors.index.json), read offline. The model is built
  on the meta device; its weights are read lazily from the files by ``SafetensorsState``,
  whose ``read_shard`` gives ``parallelize`` only the rank's slice of each tensor.
  ``options``: config fields to override (dropout, attention implementation, ...).
* ``"factory"``: ``path`` is ``FILE.py:FUNCTION`` (or ``MODULE:FUNCTION``); the function,
  called with ``options`` as keyword arguments, returns ``(model, example_batch)`` or a model.
  Its weights are whatever it built (real, or meta to be initialised shard by shard).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from fxmegatron.errors import ConfigError
from fxmegatron.models.gpt import GPT, GPTConfig
from fxmegatron.placement import Placement, Shard, shard_slices, take_shard
from fxmegatron.train.hf_weights import as_model_keys, read_merged

KINDS = ("gpt", "hf", "factory")
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


@dataclass
class ModelSource:
    """A model for the trainer and what it needs to know about it.

    ``model``: built on the meta device for "gpt" and "hf" (nothing allocated); a factory's
    model as the factory built it. ``state_dict``: the weights, read lazily (None: the
    model's own weights, or a shard-by-shard initialisation for a meta model). ``batch_kind``:
    "hf" (a batch is ``{"input_ids": [B, S], "labels": [B, S]}``, the model shifts the
    labels) or "xy" (a batch is ``(x, y)``, y already shifted). ``describe``: JSON, what
    ``fxmegatron.train.export`` needs to build the model again. ``example_batch``: what a
    factory returned with its model, if anything."""
    model: nn.Module
    state_dict: Optional[Mapping[str, torch.Tensor]]
    vocab_size: int
    max_positions: Optional[int]
    batch_kind: str
    describe: Dict[str, Any]
    example_batch: Any = None


def tied_sources(names: Sequence[str], have, model: nn.Module) -> Tuple[Dict[str, str], List[str], List[str]]:
    """Where each of ``names`` (``model``'s) is found in ``have``: under its own name, else under
    a weight tied to it (a tied LM head is stored once, under the embedding's name). Returns
    ({name: key}, the names found nowhere in model order, the keys no name is, sorted)."""
    tied = tie_groups(model)
    found, missing = {}, []
    for name in names:
        src = name if name in have else next((t for t in tied.get(name, ()) if t in have), None)
        if src is None:
            missing.append(name)
        else:
            found[name] = src
    return found, missing, sorted(set(have) - set(names))


def load_model(kind: str, path: Optional[str], options: Optional[Mapping[str, Any]],
               dtype: torch.dtype, weights: str = "load") -> ModelSource:
    """The model of kind ``kind`` ("gpt", "hf", "factory"; see the module's docstring).
    ``weights`` "random" (hf only): the folder's config.json alone, weights initialised shard by
    shard as for a meta model (pre-training an HF architecture from scratch)."""
    options = dict(options or {})
    if weights == "random" and kind == "hf":
        return _hf(path, options, dtype, random_weights=True)
    if kind == "gpt":
        return _gpt(path, options, dtype)
    if kind == "hf":
        return _hf(path, options, dtype)
    if kind == "factory":
        return _factory(path, options, dtype)
    raise ConfigError(f"model kind {kind!r}: expected one of {list(KINDS)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- the bundled GPT --------------------------------------------------------------------------
def gpt_config(fields: Mapping[str, Any], where: str) -> GPTConfig:
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown GPT option(s) {unknown}; GPTConfig has {sorted(known)}")
    return GPTConfig(**fields)


def _gpt(path, options, dtype) -> ModelSource:
    fields, state_dir = dict(options), None
    if path is not None:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{cfg_path}: no such file (a GPT folder is written by `fxmegatron export`)")
        with open(cfg_path) as f:
            saved = json.load(f)
        if not isinstance(saved.get("gpt_config"), dict):
            raise ConfigError(f"{cfg_path}: no 'gpt_config' (not a GPT folder written by `fxmegatron export`)")
        fields = {**saved["gpt_config"], **options}
        state_dir = path
    cfg = gpt_config(fields, path or "model options")
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    model.train()
    state = SafetensorsState.from_folder(state_dir, model, dtype) if state_dir else None
    return ModelSource(model, state, cfg.vocab_size, cfg.block_size, "xy",
                       {"kind": "gpt", "gpt_config": dataclasses.asdict(cfg), "dtype": dtype_name(dtype)})


# ---- Hugging Face folders -----------------------------------------------------------------------
def build_hf(config, dtype: torch.dtype) -> nn.Module:
    """An ``AutoModelForCausalLM`` of ``config`` with its parameters on the meta device and its
    non-persistent buffers (rotary frequencies, masks, scales) computed on the CPU, as
    ``from_pretrained`` does: they are in no file, and ``parallelize`` takes buffers from the
    model."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    persistent = set(model.state_dict().keys())
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    for name in meta_buffers:
        owner, _, leaf = name.rpartition(".")
        mod = model.get_submodule(owner)
        mod.register_buffer(leaf, torch.empty_like(mod.get_buffer(leaf), device="cpu"),
                            persistent=name in persistent)
    if meta_buffers:
        # meta parameters make this cheap: only the buffers get values
        model.initialize_weights()
    model.train()
    return model


def _hf(path, options, dtype, random_weights: bool = False) -> ModelSource:
    from transformers import AutoConfig
    if path is None or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model path {path!r}: expected a folder written by save_pretrained (with config.json)")
    try:
        config, unused = AutoConfig.from_pretrained(path, local_files_only=True, return_unused_kwargs=True,
                                                    **options)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{os.path.join(path, 'config.json')}: {type(exc).__name__}: {exc}") from exc
    if unused:
        raise ConfigError(f"model options {sorted(unused)}: not fields of {type(config).__name__} "
                          f"({os.path.join(path, 'config.json')})")
    model = build_hf(config, dtype)
    state = None if random_weights else SafetensorsState.from_folder(path, model, dtype)
    with torch.no_grad():       # persistent buffers come from the files, like the weights
        for name, buf in model.named_buffers():
            if state is not None and name in state:
                buf.copy_(state[name])
    text = config.get_text_config()
    return ModelSource(model, state, int(text.vocab_size), getattr(text, "max_position_embeddings", None), "hf",
                       {"kind": "hf", "config": config.to_dict(), "dtype": dtype_name(dtype)})


# ---- factories ---------------------------------------------------------------------------------
def _factory(path, options, dtype) -> ModelSource:
    from fxmegatron.factory import load_factory
    if not path:
        raise ConfigError("model kind 'factory' needs a path FILE.py:FUNCTION or MODULE:FUNCTION")
    try:
        fn = load_factory(path)
    except (SystemExit, ImportError, OSError, AttributeError) as exc:
        raise ConfigError(f"model factory {path!r}: {type(exc).__name__}: {exc}") from exc
    out = fn(**options)
    model, batch = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model factory {path!r} returned a {type(model).__name__}, expected an nn.Module "
                          "or (model, example_batch)")
    model = model.to(dtype)
    config = getattr(model, "config", None)
    if isinstance(batch, Mapping):
        kind = "hf"
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        kind = "xy"
    elif batch is None and config is not None:
        kind = "hf"
    else:
        raise ConfigError(f"model factory {path!r}: cannot tell the batch form; return (model, example_batch) "
                          "with a dict {input_ids, labels} or a tuple (x, y)")
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise ConfigError(f"model factory {path!r}: the model has no config.vocab_size and no nn.Embedding "
                              "to read the vocabulary size from")
        vocab = emb.num_embeddings
    return ModelSource(model, None, int(vocab), getattr(config, "max_position_embeddings", None), kind,
                       {"kind": "factory", "factory": path, "options": options, "dtype": dtype_name(dtype)},
                       batch)


# ---- lazy weights ------------------------------------------------------------------------------
class SafetensorsState(Mapping):
    """name -> tensor of a model, read from safetensors files only when asked, cast to
    ``dtype``. ``read_shard`` reads only a rank's slice (``parallelize`` calls it while
    materialising, see ``fxmegatron.lower.materialize``). A tied name absent from the files
    (``lm_head.weight`` saved once, as the embedding) reads the tensor it is tied to."""

    def __init__(self, keys: Mapping[str, tuple], dtype: torch.dtype, merged: Optional[Mapping[str, tuple]] = None):
        self.keys_of = dict(keys)       # model name -> (file, key in the file)
        self.merged = dict(merged or {})    # model name -> (converter, sources, shape): train.hf_weights
        self.dtype = dtype

    @classmethod
    def from_folder(cls, folder: str, model: nn.Module, dtype: torch.dtype) -> "SafetensorsState":
        """The state of ``model`` in ``folder``; every parameter and persistent buffer of the
        model must be there (or be tied to one that is) with its shape, and nothing else. The
        folder's keys are read as transformers loads them (``train.hf_weights``: renamed, and
        some put together from several tensors, such as a Mixtral folder's per-expert weights)."""
        in_files = _tensors_in_folder(folder)
        expected = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        direct, merged, left = as_model_keys(model, in_files)
        found, missing, unexpected = tied_sources(list(expected), set(direct) | set(merged), model)
        unexpected = sorted(set(unexpected) | set(left))
        if missing:
            raise ConfigError(f"{folder}: no tensor {missing[0]!r} in its safetensors files; "
                              f"{type(model).__name__} expects it")
        if unexpected:
            raise ConfigError(f"{in_files[unexpected[0]][0] if unexpected[0] in in_files else folder}: tensor "
                              f"{unexpected[0]!r} is not a parameter or buffer of {type(model).__name__} "
                              f"({len(unexpected)} such), nor one that transformers' own conversion of this model's "
                              "checkpoints makes into one; use kind 'factory' with a function that calls "
                              "from_pretrained for such a folder")
        keys = {name: direct[src] for name, src in found.items() if src in direct}
        joined = {name: (*merged[src], expected[name]) for name, src in found.items() if src in merged}
        for name, (fpath, key) in keys.items():
            with safe_open(fpath, "pt") as f:
                shape = tuple(f.get_slice(key).get_shape())
            if shape != expected[name]:
                raise ConfigError(f"{fpath}: tensor {key!r} has shape {list(shape)}; {type(model).__name__}'s "
                                  f"{name} has {list(expected[name])}")
        return cls(keys, dtype, joined)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.merged:
            return read_merged(name, *self.merged[name]).to(self.dtype)
        fpath, key = self.keys_of[name]
        with safe_open(fpath, "pt") as f:
            return f.get_tensor(key).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.keys_of, *self.merged])

    def __len__(self) -> int:
        return len(self.keys_of) + len(self.merged)

    def __contains__(self, name) -> bool:
        return name in self.keys_of or name in self.merged

    def read_shard(self, name: str, plc: Placement, rank: int, world: int) -> torch.Tensor:
        """``take_shard(self[name], plc, rank, world)``, reading only those rows or columns."""
        if not isinstance(plc, Shard) or name in self.merged:
            return take_shard(self[name], plc, rank, world)
        fpath, key = self.keys_of[name]
        with safe_open(fpath, "pt") as f:
            sl = f.get_slice(key)
            size = sl.get_shape()[plc.dim]
            lead = (slice(None),) * plc.dim
            parts = [sl[lead + (slice(start, start + n),)] for start, n in shard_slices(size, plc, rank, world)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, plc.dim)
        return out.to(self.dtype)


def _tensors_in_folder(folder: str) -> Dict[str, tuple]:
    """{key: (file, key)} of the safetensors weights in ``folder`` (one file or an index)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ConfigError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE} (fxmegatron reads safetensors "
                          "weights only; save with save_pretrained(..., safe_serialization=True))")
    out = {}
    for fname in files:
        fpath = os.path.join(folder, fname)
        if not os.path.isfile(fpath):
            raise ConfigError(f"{folder}: {fname} is listed in {INDEX_FILE} but missing")
        try:
            with safe_open(fpath, "pt") as f:
                for key in f.keys():
                    out[key] = (fpath, key)
        except (SafetensorError, OSError) as exc:      # safetensors' own message names no file
            raise ConfigError(f"{fpath}: not a readable safetensors file (truncated or corrupted?): {exc}") from exc
    return out


def tie_groups(model: nn.Module) -> Dict[str, list]:
    """{name: the other names of its Parameter} for the tied weights of ``model``."""
    by_id: Dict[int, list] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return {n: [m for m in names if m != n] for names in by_id.values() if len(names) > 1 for n in names}
