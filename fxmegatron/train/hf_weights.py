"""A ``save_pretrained`` folder's tensors under the names the model has, as transformers loads them.

transformers (5.x) saves some models in their checkpoints' historical layout and converts on
load: a Mixtral folder holds ``block_sparse_moe.experts.{e}.w1.weight`` for each expert, which
``from_pretrained`` renames and stacks into ``mlp.experts.gate_up_proj``. The trainer reads
folders lazily, a rank's slice at a time, so it cannot call ``from_pretrained``; it asks
transformers for the same conversion instead: the model's own list of renamings and
converters (``conversion_mapping.get_model_conversion_mapping``), its key renaming
(``core_model_loading.rename_source_key``) and, when a converted tensor is read, the
converter's own operations (``WeightConverter.convert``). Nothing here knows a model family.
"""
from __future__ import annotations

import copy
import functools
from typing import Dict, List, Mapping, Tuple

import torch
import torch.nn as nn
from safetensors import safe_open

from fxmegatron.errors import ConfigError


def _transforms(model: nn.Module):
    """(renamings, converters) transformers applies when loading ``model``; ([], []) for a model
    that is not a transformers one, or a transformers without conversion mappings."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    mapping = get_model_conversion_mapping(model) or []
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def as_model_keys(model: nn.Module, in_files: Mapping[str, tuple]
                  ) -> Tuple[Dict[str, tuple], Dict[str, tuple], List[str]]:
    """The folder's tensors (``in_files``: {key: (file, key)}) under ``model``'s names:
    ({name: (file, key)} read as they are, {name: (converter, [(file, key, pattern), ...])} put
    together by a converter, the file keys no name takes)."""
    renamings, converters = _transforms(model)
    if not renamings and not converters:
        return dict(in_files), {}, []
    from transformers.core_model_loading import dot_natural_key, rename_source_key
    names = model.state_dict(keep_vars=True)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    direct: Dict[str, tuple] = {}
    merged: Dict[str, tuple] = {}
    left: List[str] = []
    for key in sorted(in_files, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None), names)
        if name not in names and key in names:      # as transformers does: the key was the model's already
            name, pattern = key, None
        if name not in names:
            left.append(key)
        elif pattern is None:
            direct[name] = in_files[key]
        else:
            merged.setdefault(name, (by_pattern[pattern], []))[1].append((*in_files[key], pattern))
    return direct, merged, left


def _read(fpath: str, key: str) -> torch.Tensor:
    with safe_open(fpath, "pt") as f:
        return f.get_tensor(key)


def read_merged(name: str, converter, sources, shape) -> torch.Tensor:
    """Model tensor ``name`` from its source tensors, through a fresh copy of ``converter``;
    ConfigError when the result is not of the model's ``shape``."""
    conv = copy.deepcopy(converter)
    for fpath, key, pattern in sources:
        conv.add_tensor(name, key, pattern, functools.partial(_read, fpath, key))
    out = conv.convert(name)
    if name not in out:
        raise ConfigError(f"{sources[0][0]}: transformers' conversion of {[k for _, k, _ in sources[:2]]}... gave "
                          f"{sorted(out)}, not {name!r}")
    t = out[name]
    if tuple(t.shape) != tuple(shape):
        raise ConfigError(f"{sources[0][0]}: {name!r} put together from {len(sources)} tensors "
                          f"({sources[0][1]!r}, ...) has shape {list(t.shape)}; the model's is {list(shape)}")
    return t
