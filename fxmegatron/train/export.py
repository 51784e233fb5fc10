"""``fxmegatron export CHECKPOINT OUTDIR``: a trainer checkpoint back to a model folder.

The checkpoint (``fxmegatron.io.checkpoint.save``, at any (dp, pp, tp)) holds every
parameter in tensor-parallel pieces; ``read_full_state`` puts each back together, once.
What the model is comes from the description the trainer stored with it
(``index["extra"]["model"]``, ``ModelSource.describe``):

* "hf": the ``AutoModelForCausalLM`` of the saved config with those weights, written by
  ``save_pretrained`` (config.json, safetensors), so ``from_pretrained(OUTDIR)`` loads it.
  The tokenizer the trainer wrote into ``CHECKPOINT/tokenizer/`` is written alongside, first
  and by its own ``save_pretrained`` (its files only: never a model folder's weights).
* "gpt": the bundled GPT is not a Hugging Face model. OUTDIR gets model.safetensors (a tied
  LM head stored once, under its first name in the model's order: the embedding's) and config.json
  ``{"fxmegatron_model": "gpt", "gpt_config": {GPTConfig fields}, "dtype": ...}``; load it
  with ``fxmegatron.train.models.load_model("gpt", OUTDIR, {}, dtype)`` (or ``GPT(GPTConfig(
  **gpt_config)).load_state_dict(weights, strict=False)``, the missing key being the tied head).
* "factory": the factory is called again for the model; it is written by ``save_pretrained``
  when it has one, else as "gpt" is (config.json names the factory).

Every export ends by reading the folder back and comparing each tensor with the checkpoint's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Mapping

import torch
import torch.nn as nn
from safetensors.torch import save_file

from fxmegatron.errors import CheckpointError, ConfigError, DataError, ExportError, FxMegatronError
from fxmegatron.io.checkpoint import read_extra, read_full_state
from fxmegatron.train.models import SafetensorsState, build_hf, load_model, tied_sources
from fxmegatron.train.documents import save_tokenizer

TOKENIZER_DIR = "tokenizer"


def export_checkpoint(checkpoint_dir: str, out_dir: str) -> str:
    """Write the model of ``checkpoint_dir`` to ``out_dir`` (see the module's docstring);
    returns ``out_dir``."""
    if os.path.abspath(checkpoint_dir) == os.path.abspath(out_dir):
        raise ExportError(f"{out_dir}: the output folder is the checkpoint itself")
    try:
        described = read_extra(checkpoint_dir).get("model")
        if not isinstance(described, dict) or "kind" not in described:
            raise ExportError(f"{os.path.join(checkpoint_dir, 'index.json')}: no model description "
                              "(extra['model'], written by the trainer); this checkpoint cannot be exported")
        state = read_full_state(checkpoint_dir)
    except CheckpointError as exc:
        raise ExportError(f"cannot export {checkpoint_dir}: {exc}") from exc
    kind = described["kind"]
    where = os.path.join(checkpoint_dir, "index.json")
    if kind not in ("hf", "gpt", "factory"):
        raise ExportError(f"{where}: model kind {kind!r} in extra['model'], expected hf, gpt or factory")
    os.makedirs(out_dir, exist_ok=True)
    # The tokenizer first: whatever it writes, the model's own files come after it.
    _copy_tokenizer(checkpoint_dir, out_dir)
    dtype = _dtype(described, where)
    model = None
    if kind == "hf":
        _export_hf(described, state, out_dir, where)
    elif kind == "gpt":
        _check_names(load_model("gpt", None, described.get("gpt_config", {}), dtype).model, state, where)
        _write_plain(state, out_dir, {"fxmegatron_model": "gpt", "gpt_config": described["gpt_config"],
                                      "dtype": described.get("dtype")})
    else:
        model = _export_factory(described, state, out_dir, where)
    _verify(out_dir, kind, model, state, dtype)
    return out_dir


def _dtype(described: Mapping, where: str) -> torch.dtype:
    name = described.get("dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ExportError(f"{where}: extra['model']['dtype'] = {name!r} is not a torch dtype")
    return dtype


def _check_names(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> Dict[str, torch.Tensor]:
    """``state`` under every parameter name of ``model`` (a tied name from its twin), shapes
    checked; a parameter the checkpoint lacks, or a tensor the model has no place for, is an
    ExportError."""
    params = dict(model.named_parameters(remove_duplicate=False))
    found, missing, extra = tied_sources(list(params), state, model)
    if missing:
        raise ExportError(f"{where}: the checkpoint has no parameter {missing[0]!r} of {type(model).__name__}")
    out = {}
    for name, src in found.items():
        if tuple(state[src].shape) != tuple(params[name].shape):
            raise ExportError(f"{where}: {src} has shape {list(state[src].shape)} in the checkpoint, "
                              f"{type(model).__name__} wants {list(params[name].shape)}")
        out[name] = state[src]
    if extra:
        raise ExportError(f"{where}: the checkpoint's parameter {extra[0]!r} is not one of {type(model).__name__}'s "
                          f"({len(extra)} such)")
    return out


def load_into(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Give a model built on the meta device the checkpoint's tensors as its parameters,
    tied weights staying one Parameter."""
    full = _check_names(model, state, where)
    new_of: Dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in new_of:
            new_of[id(p)] = nn.Parameter(full[name].to(p.dtype).contiguous(), requires_grad=p.requires_grad)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, new_of[id(p)])


def _export_hf(described: Mapping, state, out_dir: str, where: str) -> None:
    from transformers import AutoConfig
    saved = dict(described.get("config") or {})
    model_type = saved.pop("model_type", None)
    if model_type is None:
        raise ExportError(f"{where}: extra['model']['config'] has no model_type")
    try:
        config = AutoConfig.for_model(model_type, **saved)
    except (ValueError, KeyError) as exc:
        raise ExportError(f"{where}: the saved config does not build: {exc}") from exc
    model = build_hf(config, _dtype(described, where))
    load_into(model, state, where)
    model.save_pretrained(out_dir)


def _export_factory(described: Mapping, state, out_dir: str, where: str) -> nn.Module:
    source = load_model("factory", described.get("factory"), described.get("options") or {},
                        _dtype(described, where))
    model = source.model
    if hasattr(model, "save_pretrained"):
        load_into(model, state, where)
        model.save_pretrained(out_dir)
    else:
        _check_names(model, state, where)
        _write_plain(state, out_dir, {"fxmegatron_model": "factory", "factory": described.get("factory"),
                                      "options": described.get("options") or {}, "dtype": described.get("dtype")})
    return model


def _write_plain(state: Mapping[str, torch.Tensor], out_dir: str, config: dict) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _copy_tokenizer(checkpoint_dir: str, out_dir: str) -> None:
    """The tokenizer's files only: checkpoints written before the trainer kept only those hold a
    whole model folder in ``tokenizer/`` (the fine-tune recipe's), whose weights are the untrained
    ones."""
    src = os.path.join(checkpoint_dir, TOKENIZER_DIR)
    if not os.path.isdir(src):
        return
    try:
        save_tokenizer(src, out_dir)
    except DataError as exc:
        raise ExportError(f"cannot export the tokenizer of {checkpoint_dir}: {exc}") from exc


def _verify(out_dir: str, kind: str, model, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Read back what ``out_dir`` holds, through the model its own config.json builds (a factory's:
    ``model``, as the factory built it), and compare every tensor with the checkpoint's: an export
    that is not the trained model must fail here, not in its user's evaluation."""
    try:
        if kind == "hf":
            from transformers import AutoConfig
            model = build_hf(AutoConfig.from_pretrained(out_dir, local_files_only=True), dtype)
        elif kind == "gpt":
            model = load_model("gpt", out_dir, {}, dtype).model
        back = SafetensorsState.from_folder(out_dir, model, dtype)
        expected = _check_names(model, state, out_dir)
    except (ConfigError, ExportError, OSError, ValueError) as exc:
        raise ExportError(f"{out_dir}: the written folder does not read back as the checkpoint's model: {exc}") from exc
    for name, want in expected.items():
        got = back[name]
        if not torch.equal(got, want.to(dtype)):
            raise ExportError(f"{out_dir}: {name} as written differs from the checkpoint's (max difference "
                              f"{(got.float() - want.float()).abs().max().item():.3g}); this folder is not "
                              "the trained model")


def main(argv=None) -> int:
    """``fxmegatron export CHECKPOINT OUTDIR``; 0 on success, 1 (the error on stderr) if not."""
    ap = argparse.ArgumentParser(prog="fxmegatron export",
                                 description="write a trainer checkpoint (any dp, pp, tp) as one model folder "
                                             "(save_pretrained for Hugging Face models)")
    ap.add_argument("checkpoint", help="a checkpoint folder written by the trainer (with index.json)")
    ap.add_argument("out", help="the folder to write")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out)
    except FxMegatronError as exc:
        print(f"fxmegatron export: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    files = sorted(os.listdir(out))
    print(f"fxmegatron export: {args.checkpoint} -> {out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
