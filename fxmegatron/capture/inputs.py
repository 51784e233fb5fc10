"""What the captured graph reads, checked before and after capture.

* Inputs that share storage are captured as distinct inputs. ``torch.export`` binds
  every use of one tensor object to one placeholder, so HF's idiom
  ``{"input_ids": x, "labels": x}`` would make the graph read its labels where the
  model reads ids: every later batch would feed its labels (with -100) to the
  embedding. The example batch's leaves are cloned apart before export.
* A training graph holds no inference cache: a forward that takes ``use_cache``
  (HF causal LMs, whose default config turns it on) is captured with
  ``use_cache=False`` unless the batch sets it. A cache is an output the loss does
  not need and, concatenated into k and v, hides the attention's split.
* The graph's output must be a scalar floating loss.
* At run time a batch must have the example's structure and shapes (the graph is
  traced at those shapes); ``check_batch`` names both.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxmegatron.errors import BatchError, CaptureError


def distinct_inputs(args: tuple, kwargs: dict) -> Tuple[tuple, dict, List[str]]:
    """(args, kwargs) with every tensor leaf that shares storage with an earlier one cloned;
    also the names of the leaves that were cloned (for the plan)."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    seen_ids, seen_storage = set(), set()
    out, cloned = [], []
    for path, x in leaves:
        if isinstance(x, torch.Tensor):
            storage = None if x.device.type == "meta" else x.untyped_storage().data_ptr()
            if id(x) in seen_ids or (storage is not None and storage != 0 and storage in seen_storage):
                x = x.clone()
                cloned.append(pytree.keystr(path))
            seen_ids.add(id(x))
            if storage:
                seen_storage.add(x.untyped_storage().data_ptr())
        out.append(x)
    args, kwargs = pytree.tree_unflatten(out, spec)
    return args, kwargs, cloned


def training_kwargs(model: nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments the training graph is captured with beyond the batch's own."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    if "use_cache" in params and "use_cache" not in kwargs:
        return {"use_cache": False}
    return {}


def check_scalar_loss(model: nn.Module, out_val) -> None:
    if not isinstance(out_val, torch.Tensor) or out_val.ndim != 0 or not out_val.is_floating_point():
        what = (f"a tensor of shape {list(out_val.shape)} and dtype {out_val.dtype}"
                if isinstance(out_val, torch.Tensor) else type(out_val).__name__)
        raise CaptureError(f"{type(model).__name__}.forward returned {what} as its loss: fxmegatron trains a "
                           "model whose forward(batch) returns a scalar floating loss (e.g. the mean "
                           "cross-entropy; HF models return one when given labels=)")


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"
    return repr(x)


def check_batch(flat: Sequence, example: Sequence, names: Sequence[str], what: str) -> None:
    """Each input of a (micro)batch against the example's: same shape and dtype, or an error
    naming both. ``what`` says which piece this is (e.g. "microbatch of 2 rows")."""
    for x, ex, name in zip(flat, example, names):
        if isinstance(ex, torch.Tensor) != isinstance(x, torch.Tensor):
            raise BatchError(f"batch input {name!r} is {describe(x)} where the example batch had {describe(ex)}")
        if not isinstance(ex, torch.Tensor):
            continue
        if tuple(x.shape) != tuple(ex.shape) or x.dtype != ex.dtype:
            raise BatchError(
                f"batch input {name!r}: each {what} is {describe(x)}, but the graph was captured for "
                f"{describe(ex)} (from the example batch given to parallelize). The graph's shapes are "
                "static: give batches of the example's batch size and sequence length (pad the last "
                "partial batch, masking its labels with -100), or parallelize again with an example "
                "of the new shape")


def _input_name(path) -> str:
    """A leaf's place in (args, kwargs) in the batch's own terms: key 'labels' of a dict batch,
    element 1 of a tuple batch (batch_args made the dict kwargs and the tuple args)."""
    if len(path) < 2:
        return pytree.keystr(path) or "the batch"
    head, rest = path[1], pytree.keystr(path[2:])
    if isinstance(head, pytree.MappingKey):
        return f"key {head.key!r}{rest}"
    return f"element {getattr(head, 'idx', head)}{rest}"


def structure_difference(args: tuple, kwargs: dict, example_spec) -> str:
    """Why the batch (args, kwargs) does not have the example batch's pytree structure, naming
    the inputs it lacks and those the example has not; the two structures when only the
    containers differ (a list for a tuple)."""
    given = {pytree.keystr(p): p for p, _ in pytree.tree_flatten_with_path((args, kwargs))[0]}
    dummy = pytree.tree_unflatten(list(range(example_spec.num_leaves)), example_spec)
    wanted = {pytree.keystr(p): p for p, _ in pytree.tree_flatten_with_path(dummy)[0]}
    missing = [_input_name(p) for k, p in wanted.items() if k not in given]
    extra = [_input_name(p) for k, p in given.items() if k not in wanted]
    parts = ([f"is missing {', '.join(missing)}"] if missing else []) + \
            ([f"has {', '.join(extra)}, which the example batch has not"] if extra else [])
    if not parts:
        return (f"the batch's structure {pytree.tree_flatten((args, kwargs))[1]} differs from the example "
                f"batch's {example_spec}")
    return (f"the batch {' and '.join(parts)} (the example batch given to parallelize has "
            f"{', '.join(_input_name(p) for p in wanted.values())}): give every batch the example's inputs")
