"""How a training run ends: the exit status an error gives, and the check that stops (or skips)
a step whose loss or gradient norm is not finite."""
from __future__ import annotations

import math

import torch

from fxmegatron.errors import (ConfigError, FxMegatronError, PassError, PipelineError, TrainingError,
                               VerificationError)

BAD_INPUT, FAILED = 2, 1      # the trainer's exit statuses (docs/TRAINER.md)


def exit_status(exc: BaseException) -> int:
    """2 for bad input (a config, data, checkpoint, model or layout that does not fit: any
    fxmegatron error but those below), 1 for a failure of the run itself: a non-finite loss, a
    peer that failed, a compiler bug, a parallel program that computes otherwise, any other
    exception."""
    if isinstance(exc, FxMegatronError) and not isinstance(exc, (TrainingError, PipelineError, PassError,
                                                                 VerificationError)):
        return BAD_INPUT
    return FAILED


def check_finite(step: int, loss, grad_norm=None, policy: str = "stop") -> bool:
    """True when ``loss`` and ``grad_norm`` (tensors or numbers; None is not checked) are
    finite. Otherwise ``policy`` "stop" raises TrainingError naming the step and the value,
    and "skip" returns False: the trainer drops this step's update."""
    if policy not in ("stop", "skip"):
        raise ConfigError(f"non-finite policy must be 'stop' or 'skip', got {policy!r}")
    named = [(n, v) for n, v in (("loss", loss), ("grad norm", grad_norm)) if v is not None]
    tensors = [v for _, v in named if isinstance(v, torch.Tensor)]
    if tensors and len({t.device for t in tensors}) == 1:
        # one device sync for both values instead of one each
        got = iter(torch.stack([t.detach().reshape(()).float() for t in tensors]).tolist())
        nums = [next(got) if isinstance(v, torch.Tensor) else float(v) for _, v in named]
    else:
        nums = [float(v) for _, v in named]
    bad = [f"{n} is {x}" for (n, _), x in zip(named, nums) if not math.isfinite(x)]
    if not bad:
        return True
    if policy == "skip":
        return False
    raise TrainingError(f"step {step}: {' and '.join(bad)} (non-finite policy 'stop')")


def pack_failure(code: int, msg: str) -> str:
    """A failure as the watchdog publishes it: its exit status travels with it, so a rank that
    reads a peer's bad input (2) before meeting it ends silently with 2 (the job says it once)."""
    return f"{code}:{msg}"


def unpack_failure(value: bytes) -> tuple:
    code, _, msg = value.decode(errors="replace").partition(":")
    return int(code), msg
