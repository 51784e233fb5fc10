"""Measuring activation memory: bytes autograd keeps for backward."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def saved_bytes(exclude=()):
    """Count the bytes of distinct storages saved for backward inside the block
    (``torch.autograd.graph.saved_tensors_hooks``), skipping ``exclude`` (parameters).
    Yields a dict whose "bytes" is filled in on exit."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip:
                seen[ptr] = t.untyped_storage().nbytes()
        return t

    out = {"bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    out["bytes"] = sum(seen.values())
