"""Whether Triton kernels (generated or hand-written) run on a tensor, or its torch form does.

Kernels run on real CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the
tests). They never run on the fake and meta tensors of shape propagation, nor while
torch.compile traces: inductor then generates the kernels of the torch form.
"""
from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake


def kernels_run(x: torch.Tensor, interpreter: bool = True) -> bool:
    """Whether generated kernels run on ``x``: a real tensor (shape propagation runs ops on
    fake and meta ones) on a GPU, or on CPU under ``TRITON_INTERPRET=1`` when ``interpreter``.
    Never while torch.compile traces: inductor then generates the kernels of the torch form."""
    if torch.compiler.is_compiling() or is_fake(x) or x.device.type == "meta":
        return False
    return x.is_cuda or (interpreter and os.environ.get("TRITON_INTERPRET") == "1")


def table_kernels_run(x: torch.Tensor) -> bool:
    """``kernels_run`` for the multi-tensor kernels that read tensor addresses from a table
    (``FusedAdamW``, the fp32 gradient accumulation): not on CUDA tensors under
    ``TRITON_INTERPRET=1``, where the interpreter copies tensor arguments to the host and the
    device addresses in the table would be read on the host."""
    if x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return kernels_run(x)


def kernels_in_compiled_graph(x: torch.Tensor) -> bool:
    """Whether torch.compile is tracing ``x`` for a device where kernels run: an op that runs
    them (the fused cross-entropy) then stays a call in the compiled graph."""
    return torch.compiler.is_compiling() and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
