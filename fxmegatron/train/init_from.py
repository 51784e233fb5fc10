"""``model.init_from = PATH``: a new run that starts from weights saved elsewhere.

PATH is a trainer checkpoint (a step folder with index.json, saved at any layout) or a model
folder (``fxmegatron export``'s or ``save_pretrained``'s safetensors). Weights only: unlike a
resume, the run starts at step 0 with a fresh optimizer and dropout stream, reads its own data
(no data fingerprint is compared) and has its own layout. The architecture is the config's
(model.kind, path, gpt) as in any run; PATH must hold every parameter of it with its shape and
nothing else, or the run ends before any process group work with a ConfigError naming the first
that does not fit.

The weights go where a loaded folder's go, ``ModelSource.state_dict``: ``parallelize`` asks it
for each rank's piece of each tensor while it materialises the rank (``lower.materialize``),
so no rank holds the whole model and nothing is gathered. A model folder is read as
``model.weights = "load"`` reads one (``SafetensorsState``: the rank's rows or columns only); a
checkpoint as a resume reads one (``CheckpointReader.full``: one tensor at a time put together
from the pieces of the layout that saved it, then cut for this rank).

A resumable checkpoint of this run (what ``checkpoint.resume`` would take) wins: init_from is
then not read at all, so a job restarted after a crash goes on from its own last step.
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, Mapping

import torch
import torch.nn as nn

from fxmegatron.errors import CheckpointError, ConfigError
from fxmegatron.io.checkpoint_reader import CheckpointReader
from fxmegatron.placement import Placement, take_shard
from fxmegatron.train import checkpoints
from fxmegatron.train.models import SafetensorsState, tied_sources


def resumes(cfg) -> bool:
    """Whether the run will resume (``loop.train``'s ``checkpoints.resume_from``), told without
    its messages: "auto" finds a complete checkpoint in checkpoint.dir, or a folder is named."""
    r = cfg.checkpoint.resume
    return r != "none" and (r != "auto" or bool(checkpoints.complete(cfg.checkpoint.dir)))


def init_state(path: str, model: nn.Module, dtype: torch.dtype, where: str) -> Mapping[str, torch.Tensor]:
    """The weights of ``model`` (built on meta) in ``path``, read lazily; ConfigError (``where``:
    the config file) naming the first parameter that is missing, extra or of another shape."""
    key = f"{where}: model.init_from {path}"
    if not os.path.isdir(path):
        raise ConfigError(f"{key} is not a folder (a trainer checkpoint with index.json, or a model folder "
                          "written by fxmegatron export or save_pretrained)")
    if os.path.isfile(os.path.join(path, "index.json")):
        return CheckpointState.open(path, model, dtype, key)
    found = checkpoints.complete(path)
    if found:
        raise ConfigError(f"{key} is a folder of checkpoints, not one: name one of them, e.g. the latest, "
                          f"{found[-1]}")
    try:
        state = SafetensorsState.from_folder(path, model, dtype)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    with torch.no_grad():       # persistent buffers come from the folder too, as model.weights = "load" does
        for name, buf in model.named_buffers():
            if name in state and buf.device.type != "meta":
                buf.copy_(state[name])
    return state


class CheckpointState(Mapping):
    """model name -> tensor of a trainer checkpoint's parameters (a tied name reads the weight
    it is tied to), each read when asked, cast to ``dtype``."""

    def __init__(self, reader: CheckpointReader, keys: Dict[str, str], dtype: torch.dtype):
        self.reader = reader
        self.keys_of = keys         # model name -> the checkpoint's parameter name
        self.dtype = dtype

    @classmethod
    def open(cls, path: str, model: nn.Module, dtype: torch.dtype, key: str) -> "CheckpointState":
        try:
            rd = CheckpointReader(path)
        except CheckpointError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        saved = {k[len("model/"):] for k in rd.pieces if k.startswith("model/")}
        params = dict(model.named_parameters(remove_duplicate=False))
        found, missing, extra = tied_sources(list(params), saved, model)
        what = f"the config's model ({type(model).__name__})"
        if missing:
            raise ConfigError(f"{key}: the checkpoint has no parameter {missing[0]!r} of {what} ({len(missing)} "
                              "missing): a checkpoint of another model")
        if extra:
            raise ConfigError(f"{key}: the checkpoint's parameter {extra[0]!r} is not one of {what} ({len(extra)} "
                              "such): a checkpoint of another model")
        for name, src in found.items():
            shape = list(rd.shape("model/" + src))
            if shape != list(params[name].shape):
                raise ConfigError(f"{key}: the checkpoint's {src!r} has shape {shape}; in {what} it is "
                                  f"{list(params[name].shape)}")
        return cls(rd, found, dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.reader.full("model/" + self.keys_of[name]).to(self.dtype)
        except CheckpointError as exc:      # a shard changed since the check above: said as init_from's
            raise ConfigError(f"model.init_from {self.reader.directory}: {exc}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_of)

    def __len__(self) -> int:
        return len(self.keys_of)

    def __contains__(self, name) -> bool:
        return name in self.keys_of

    def read_shard(self, name: str, plc: Placement, rank: int, world: int) -> torch.Tensor:
        """Rank ``rank``'s piece: the tensor put together from the checkpoint's pieces, then cut,
        as a resume at another layout does (``CheckpointReader.local``)."""
        return take_shard(self[name], plc, rank, world).contiguous()
