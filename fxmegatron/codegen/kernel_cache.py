"""Triton source text -> jitted kernel, compiled once per process: ``compile_source``.

Both the generated kernels (``fxmegatron.codegen.fused_chain``) and the hand-written ones
(``fxmegatron.kernels``, the fp32 gradient accumulation) are kept as source text. A source
is written to a file under the temporary folder (``triton.jit`` reads a function's source
from its file) and imported; the kernel is held in ``KERNEL_CACHE`` for the rest of the
process.

Threads: ``fxmegatron.verify`` runs its simulated ranks as threads of one process, so the
cache is shared by threads that compile and launch the same kernels.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import threading
from typing import Dict, Tuple

import torch

# The Triton interpreter keeps its state in the triton.language module, so two threads
# interpreting kernels at once break each other: interpreted launches take turns.
# Compiled kernels are launched freely.
_INTERPRETER_LOCK = threading.Lock()
# Writing a kernel's file goes through a pid-named .part file in a folder every cache of this
# process shares, so compilation is serialised for the process, not per cache.
_COMPILE_LOCK = threading.Lock()


class _Serialised:
    """An interpreted kernel whose launches hold ``_INTERPRETER_LOCK``."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return launch(*args, **kwargs)
        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


class KernelCache:
    """Jitted kernels by (source, name, math mode) and whether the interpreter runs them.

    Lifetime: the process. One instance, ``KERNEL_CACHE``, serves every caller, and entries
    are never evicted: a process meets a bounded set of sources (one per fused group's layout
    and per hand-written kernel), and dropping one would only make its next call import the
    file again and Triton compile it again. Safe to share between threads: a kernel is
    compiled once (under ``_COMPILE_LOCK``) and interpreted launches take turns
    (``_INTERPRETER_LOCK``)."""

    def __init__(self):
        self._kernels: Dict[Tuple[str, bool], object] = {}

    def compile(self, src: str, name: str):
        """The jitted kernel ``name`` defined in ``src``."""
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        plain = interpret or torch.version.hip is not None
        key = hashlib.sha256((name + src + str(plain)).encode()).hexdigest()[:16]
        with _COMPILE_LOCK:     # threads of one process (verify's ranks) compile a kernel once
            if (key, interpret) not in self._kernels:
                self._kernels[(key, interpret)] = _load(src, name, key, plain, interpret)
            return self._kernels[(key, interpret)]


KERNEL_CACHE = KernelCache()


def compile_source(src: str, name: str):
    """The jitted kernel ``name`` defined in ``src``, from ``KERNEL_CACHE``."""
    return KERNEL_CACHE.compile(src, name)


def _load(src: str, name: str, key: str, plain: bool, interpret: bool):
    folder = os.path.join(tempfile.gettempdir(), "fxmegatron_kernels")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"k_{key}.py")
    # triton.jit reads the source of the function from its file; several processes may write
    # the same kernel at once, so each writes its own file and renames it into place
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        f.write(f"import triton\nimport triton.language as tl\n\n_PLAIN_MATH = tl.constexpr({plain})\n\n\n" + src)
    os.replace(part, path)
    spec = importlib.util.spec_from_file_location(f"fxmegatron_kernel_{key}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernel = getattr(mod, name)
    return _Serialised(kernel) if interpret else kernel
