"""Gradients summed over a step's microbatches in fp32: Megatron's ``main_grad``.

Autograd accumulates a parameter's gradient in the parameter's own dtype. Over m
microbatches a bf16 gradient is rounded to 8 bits of mantissa m - 1 times, and the sum of
many small contributions drifts (each add of a small term to a large sum may round it
away). Here a post-accumulate-grad hook moves each microbatch's gradient into an fp32
sum and frees it; at the parameter's last accumulation of the step the sum, rounded
once, goes back into ``.grad``. The optimizer and the data-parallel reduction then see
one rounding instead of m - 1.

The hook is registered before the data-parallel ``GradSync`` one, so the bucket that
GradSync launches at a parameter's last accumulation reads the rounded sum. The fp32 sums
exist only during the step's backward (4 bytes per low-precision parameter; allocated at
its first accumulation, freed at its last).

Not done: Megatron's gradient-accumulation fusion, where the weight-gradient GEMM adds
straight into the fp32 buffer (cuBLAS with beta = 1 and an fp32 output); here each
microbatch's bf16 weight gradient is written, then added.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn

from .errors import FxMegatronError


class GradAccumError(FxMegatronError, ValueError):
    pass


def check_grad_accum_dtype(dtype) -> Optional[torch.dtype]:
    if dtype not in (None, torch.float32):
        raise GradAccumError(f"parallelize(grad_accum_dtype={dtype!r}): expected None (the parameters' dtype, "
                             "as autograd accumulates) or torch.float32")
    return dtype


class Fp32GradAccumulator:
    """Sums the step's gradients of the bf16/fp16 ``params`` in fp32 (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], uses: Dict[int, int]):
        self.params = [p for p in params if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
        self.uses = uses                     # id(param) -> accumulations per microbatch (pipeline chunks)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self._by_id = {id(p): p for p in self.params}
        self._expected: Dict[int, int] = {}
        self._count: Dict[int, int] = {}
        self._sum: Dict[int, torch.Tensor] = {}
        self.active = False

    def start(self, microbatches: int) -> None:
        """Arm for one step of ``microbatches``."""
        self._expected = {id(p): microbatches * self.uses.get(id(p), 1) for p in self.params}
        self._count = {k: 0 for k in self._expected}
        self._sum = {}
        self.active = True

    def _hook(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        k = id(p)
        self._count[k] += 1
        last = self._count[k] >= self._expected[k]
        buf = self._sum.pop(k, None)
        if buf is None:
            if last:                         # one accumulation in all: nothing was rounded
                return
            buf = p.grad.to(torch.float32, copy=True)
        else:
            buf.add_(p.grad)
        if last:
            p.grad = buf.to(p.dtype)
        else:
            self._sum[k] = buf
            p.grad = None                    # autograd starts the next microbatch's gradient afresh

    def finish(self) -> None:
        """Write back the sums of parameters that got fewer accumulations than expected (a
        microbatch that did not reach them)."""
        for k, buf in self._sum.items():
            p = self._by_id[k]
            p.grad = buf.to(p.dtype)
        self._sum = {}
        self.active = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
