"""What ``fxmegatron eval`` and ``fxmegatron generate`` run: one plain model with real weights, in
one process, from any of the three things a user holds after training.

* A trainer config (a TOML file): the latest complete checkpoint of its run
  (``checkpoint.dir``), and the config itself for the data.
* A checkpoint folder (with index.json): the model the trainer described in it
  (``extra["model"]``, as ``fxmegatron export`` reads it) with the checkpoint's weights put back
  together from its pieces (``read_full_state``, any (dp, pp, cp, tp)); the run's config saved
  in it (``extra["config"]``) for the data.
* A model folder (with config.json): a ``save_pretrained`` folder, or what ``fxmegatron export``
  wrote (the bundled GPT, a factory's model), read as the trainer reads ``model.path``
  (``train.models.load_model``). It holds no run config: the data comes from flags.

The tokenizer is the checkpoint's (``tokenizer/``, which the trainer copies there), the folder's
own tokenizer files, else the run config's ``data.tokenizer`` (``"bytes"`` included)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import torch

from fxmegatron.errors import CheckpointError, ConfigError, ExportError
from fxmegatron.io.checkpoint import read_extra, read_full_state
from fxmegatron.train import checkpoints
from fxmegatron.train.config import TEXT_KINDS, Config, from_dict, load
from fxmegatron.train.export import TOKENIZER_DIR, load_into
from fxmegatron.train.models import ModelSource, build_hf, load_model
from fxmegatron.train.setup import DTYPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Loaded:
    source: ModelSource             # ``source.model``: real weights, eval mode, on ``device``
    config: Optional[Config]        # the run's config (None: a model folder)
    tokenizer: Optional[str]        # "bytes", a tokenizer folder, or None (unknown)
    name: str                       # what was loaded, for the output line
    device: torch.device


def add_target_arguments(ap, set_help: str) -> None:
    """The flags eval and generate share: what to load, and how (``load_target``'s arguments)."""
    ap.add_argument("target", help="a trainer config (its latest checkpoint), a checkpoint folder (index.json) or "
                                   "a model folder (config.json: save_pretrained, fxmegatron export)")
    ap.add_argument("--tokenizer", default=None, help="bytes or a tokenizer folder (default: the checkpoint's)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=set_help)
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    ap.add_argument("--precision", default=None, choices=["bf16", "fp32"],
                    help="the weights' dtype (default: the checkpoint's, fp32 for a model folder)")


def load_target(target: str, overrides: List[str], device: str = "auto",
                precision: Optional[str] = None) -> Loaded:
    """The model (and run config with ``overrides``, and tokenizer) of ``target`` (see the module's docstring);
    ConfigError / ExportError naming ``target`` when it is none of the three or does not load.
    ``precision`` ("fp32", "bf16"; None: the checkpoint's own, fp32 for a folder)."""
    dev = _device(device)
    dtype = DTYPES[precision] if precision else None
    if os.path.isfile(target):
        cfg = load(target, overrides)
        found = checkpoints.complete(cfg.checkpoint.dir)
        if not found:
            raise ConfigError(f"{target}: no complete checkpoint in {cfg.checkpoint.dir} (checkpoint.dir) to load; "
                              "train first, or give a checkpoint or model folder")
        source = _from_checkpoint(found[-1], dtype)
        return _done(source, cfg, _tokenizer(found[-1], cfg), f"{found[-1]} (latest of {target})", dev)
    if os.path.isfile(os.path.join(target, "index.json")):
        saved = _extra(target).get("config")
        cfg = None
        if isinstance(saved, dict):
            cfg = from_dict(saved, f"{os.path.join(target, 'index.json')} (the run's config)", target, overrides)
        return _done(_from_checkpoint(target, dtype), cfg, _tokenizer(target, cfg), target, dev)
    if os.path.isfile(os.path.join(target, "config.json")):     # no run config: ``overrides`` are the caller's
        return _done(_from_folder(target, dtype or torch.float32), None, _tokenizer(target, None), target, dev)
    found = checkpoints.complete(target)
    if found:
        raise ConfigError(f"{target} is a folder of checkpoints, not one: name one of them, e.g. the latest, "
                          f"{found[-1]} (or give the run's config)")
    what = "does not exist" if not os.path.exists(target) else "is neither a trainer config (TOML file), a " \
        "checkpoint folder (with index.json) nor a model folder (with config.json)"
    raise ConfigError(f"{target} {what}")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no GPU here; use --device cpu")
    return dev


def _extra(ckpt: str) -> dict:
    try:
        return read_extra(ckpt)
    except CheckpointError as exc:
        raise ExportError(f"cannot read {ckpt}: {exc}") from exc


def _from_checkpoint(ckpt: str, dtype: Optional[torch.dtype]) -> ModelSource:
    """The checkpoint's model as ``fxmegatron export`` would write it, kept in memory: built on
    meta from the stored description, given the whole tensors (tied weights stay one)."""
    where = os.path.join(ckpt, "index.json")
    described = _extra(ckpt).get("model")
    if not isinstance(described, dict) or described.get("kind") not in ("hf", "gpt", "factory"):
        raise ExportError(f"{where}: no model description of kind hf, gpt or factory (extra['model'], written "
                          "by the trainer); this checkpoint's model cannot be rebuilt")
    if dtype is None:
        dtype = getattr(torch, str(described.get("dtype") or "float32"), None)
        if not isinstance(dtype, torch.dtype):
            raise ExportError(f"{where}: extra['model']['dtype'] = {described.get('dtype')!r} is not a torch dtype")
    if described["kind"] == "hf":
        source = _hf_source(described, dtype, where)
    elif described["kind"] == "gpt":
        source = load_model("gpt", None, described.get("gpt_config") or {}, dtype)
    else:
        source = load_model("factory", described.get("factory"), described.get("options") or {}, dtype)
    try:
        state = read_full_state(ckpt)
    except CheckpointError as exc:
        raise ExportError(f"cannot read {ckpt}: {exc}") from exc
    load_into(source.model, state, where)
    return source


def _hf_source(described: dict, dtype: torch.dtype, where: str) -> ModelSource:
    from transformers import AutoConfig
    saved = dict(described.get("config") or {})
    model_type = saved.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **saved)
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{where}: the saved model config does not build: {exc}") from exc
    text = config.get_text_config()
    return ModelSource(build_hf(config, dtype), None, int(text.vocab_size),
                       getattr(text, "max_position_embeddings", None), "hf", described)


def _from_folder(folder: str, dtype: torch.dtype) -> ModelSource:
    """A model folder as the trainer reads ``model.path``: an exported GPT or factory model by its
    config.json's ``fxmegatron_model``, else a Hugging Face folder."""
    import json
    with open(os.path.join(folder, "config.json")) as f:
        try:
            saved = json.load(f)
        except ValueError as exc:
            raise ConfigError(f"{os.path.join(folder, 'config.json')}: not JSON: {exc}") from exc
    kind = saved.get("fxmegatron_model", "hf") if isinstance(saved, dict) else "hf"
    if kind == "factory":
        from fxmegatron.train.models import SafetensorsState
        source = load_model("factory", saved.get("factory"), saved.get("options") or {}, dtype)
        state = SafetensorsState.from_folder(folder, source.model, dtype)
    else:
        source = load_model(kind, folder, {}, dtype)
        state = source.state_dict
    load_into(source.model, state, folder)
    return source


def _tokenizer(folder: str, cfg: Optional[Config]) -> Optional[str]:
    for cand in (os.path.join(folder, TOKENIZER_DIR), folder):
        if os.path.isdir(cand) and any(os.path.isfile(os.path.join(cand, f)) for f in TOKENIZER_FILES):
            return cand
    if cfg is not None and cfg.data.kind in TEXT_KINDS:
        return cfg.data.tokenizer
    return None


def _done(source: ModelSource, cfg, tokenizer, name: str, device: torch.device) -> Loaded:
    model = source.model.to(device)
    model.eval()        # dropout off, as the trainer's evaluation
    source.model = model
    return Loaded(source, cfg, tokenizer, name, device)
