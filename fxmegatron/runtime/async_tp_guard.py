"""The refusal of a tensor-parallel step in a process where torch's async tensor parallelism is
on (inductor's ``_micro_pipeline_tp``, as torchtitan enables it).

On two GPUs with torch 2.11, bf16, a tensor-parallel model (fxmegatron's, or PyTorch's own
DTensor model) that steps in a process where another model has run torch's async-TP ops gets
wrong gradients (the first block's attention inputs and the embeddings ~20% off, the loss
unchanged), and the async-TP model goes wrong the same way beside an fxmegatron model. The
cause is not found (docs/TRAINING.md, "Beside torch's async TP"), so fxmegatron refuses to
step there rather than train wrong. The flag is process-wide and stays on once set, which is
how torchtitan-style code leaves it; a process that turned it off again after using it is not
caught. ``ALLOW`` set to 1 lets the step run (the GPU tests that look for the cause use it)."""
from __future__ import annotations

import os
import sys
from typing import Optional

ALLOW = "FXMEGATRON_ALLOW_ASYNC_TP_BESIDE"


def async_tp_on() -> bool:
    """Whether inductor's micro-pipeline (async TP) pass is on in this process (read without
    importing inductor: a process that never imported it has not turned it on)."""
    cfg = sys.modules.get("torch._inductor.config")
    return bool(cfg is not None and getattr(cfg, "_micro_pipeline_tp", False))


def async_tp_refusal(device_type: str, tp: int) -> Optional[str]:
    """The error message for a step of a model on ``device_type`` with ``tp`` tensor-parallel
    ranks, or None when it may run."""
    if device_type != "cuda" or tp <= 1 or not async_tp_on() or os.environ.get(ALLOW) == "1":
        return None
    return (f"torch's async tensor parallelism is on in this process (torch._inductor.config._micro_pipeline_tp); "
            f"on torch 2.11 a tensor-parallel model (tp={tp}) stepping in a process where a model ran torch's "
            f"async-TP ops gets wrong gradients, PyTorch's own DTensor models too (docs/TRAINING.md, 'Beside "
            f"torch's async TP'): train fxmegatron's model in a process of its own (its tp_comm_overlap overlaps "
            f"the same collectives), or set {ALLOW}=1 to run anyway")


class AsyncTPBesideError(RuntimeError):
    pass


def check_no_async_tp(device, tp: int) -> None:
    """Raise ``AsyncTPBesideError`` where ``async_tp_refusal`` gives a reason."""
    why = async_tp_refusal(getattr(device, "type", str(device)) if device is not None else "cpu", tp)
    if why:
        raise AsyncTPBesideError(why)
