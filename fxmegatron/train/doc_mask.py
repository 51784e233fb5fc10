"""Packing without attention across documents (``data.document_mask``): what a Hugging Face
model is given besides its ids so that every document in a packed window is computed as it
would be alone.

Documents end with the tokenizer's EOS (``documents.py`` appends it), so a document starts
after each EOS. For a window's inputs ``x`` (``[B, S]``):

* ``attention_mask`` ``[B, 1, S, S]`` (bool, True: attend): causal, and only within a document
  (transformers takes a 4-D mask as given);
* ``position_ids`` ``[B, S]``: restarting at 0 at each document's first token;
* the labels of each document's first token ignored (-100): it would be predicted from the end
  of the document before, which a document alone never sees.

A window's first document may have begun in the window before: it is computed from the part
the window holds, as packing without masks does too."""
from __future__ import annotations

from typing import Tuple

import torch

IGNORE = -100


def document_inputs(x: torch.Tensor, eos: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_mask, position_ids, starts): ``starts`` is True at each token that opens a
    document after an EOS inside the window (its label is to be ignored)."""
    b, s = x.shape
    starts = torch.zeros_like(x, dtype=torch.bool)
    starts[:, 1:] = x[:, :-1] == eos
    doc = torch.cumsum(starts.to(torch.int64), dim=1)
    idx = torch.arange(s, device=x.device).expand(b, s)
    # each token's document start: the running maximum of the start positions seen so far
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return mask[:, None], idx - first, starts


def hf_batch(x: torch.Tensor, labels: torch.Tensor, eos: int) -> dict:
    """An HF model's batch of inputs ``x`` and (unshifted) ``labels``, kept inside documents."""
    mask, positions, starts = document_inputs(x, eos)
    return {"input_ids": x, "labels": torch.where(starts, IGNORE, labels), "attention_mask": mask,
            "position_ids": positions}
