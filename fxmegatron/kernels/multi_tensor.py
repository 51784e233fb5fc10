"""The layout shared by the multi-tensor kernels over flat fp32 buffers (``FusedAdamW``'s
``adamw_multi``, the fp32 gradient accumulation's ``acc_multi``).

Tensor ``i`` owns ``[offset_i, offset_i + numel_i)`` of a flat buffer, offsets rounded up to
``ALIGN`` elements. A program owns ``BLOCK * ITERS`` elements of one tensor: it reads its
(entry, first element) from a chunk table and the entry's (offset, numel) from a meta table,
both built once on the device.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

ALIGN = 64          # elements: each tensor's offset in a flat buffer is a multiple of it
# (BLOCK, ITERS, num_warps). Small under the interpreter so that tests with small tensors cross
# chunk and block boundaries.
GPU_CONFIG = (1024, 8, 4)
INTERPRET_CONFIG = (128, 2, 1)


def config(device: torch.device) -> Tuple[int, int, int]:
    return GPU_CONFIG if device.type == "cuda" else INTERPRET_CONFIG


def flat_offsets(numels: Sequence[int]) -> Tuple[List[int], int]:
    """(each tensor's offset, the buffer's length)."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


def chunk_tables(numels: Sequence[int], offsets: Sequence[int], device: torch.device):
    """(chunks [C, 2], meta [T, 2], C) on ``device`` for the entries ``numels`` / ``offsets``:
    chunk rows (entry, first element) and meta rows (offset, numel), int64. With no element at
    all C is 0 and the chunk table holds one unused row."""
    block, iters, _ = config(device)
    chunk = block * iters
    rows = [(k, s) for k, n in enumerate(numels) for s in range(0, n, chunk)]
    chunks = torch.tensor(rows if rows else [(0, 0)], dtype=torch.int64).to(device)
    meta = torch.tensor(list(zip(offsets, numels)), dtype=torch.int64).to(device)
    return chunks, meta, len(rows)
