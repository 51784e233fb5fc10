"""cuBLASLt matmuls with the epilogues torch does not expose, through ``ctypes``.

torch's ``addmm`` asks cuBLASLt for a bias epilogue and ``_addmm_activation`` for bias+GeLU,
but none keeps the GeLU's input (the backward needs it) and none computes a bias gradient.
cuBLASLt has them (``cublasLtEpilogue_t``, cuBLAS documentation):

* ``GELU_AUX_BIAS``: D = gelu(A·B + bias), and the pre-activation A·B + bias written to an aux
  matrix in the same pass;
* ``DGELU``: D = (A·B) ⊙ gelu'(aux);
* ``DGELU_BGRAD``: the same, and the bias gradient Σ D over D's columns;
* ``BGRADB``: D = A·B, and the bias gradient Σ op(B) over the GEMM's k dimension.

The GeLU is the tanh approximation, ½x(1 + tanh(√(2/π)(x + 0.044715x³))). Everything runs in
fp32 on the accumulator before the one rounding to D's dtype.

No Python package binds these (nvmath-python does, and is not in torch's dependencies):
this module loads the ``libcublasLt`` that torch itself loaded, creates one handle per
device, and caches one plan per shape, dtype, epilogue and operand alignment: descriptors,
and the fastest of the heuristic's first ``CANDIDATES`` algorithms, timed once on the first
call's own operands (for the aux-writing GeLU epilogue the heuristic's first choice is not
its fastest: 0.90 against 0.79 ms at gpt1.3b's first MLP GEMM on an H200). Row-major
tensors are handed over as their column-major transposes, so ``mm`` computes ``a @ b`` for
row-major ``a`` [m, k], ``b`` [k, n].
``available()`` is False off CUDA or when the library cannot be found; ``mm`` returns None
when cuBLASLt has no algorithm for the request, and callers fall back to ATen.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

# cublasLt.h / library_types.h values
_OP_N, _OP_T = 0, 1
_DTYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_PREF_MAX_WORKSPACE = 1
_PREF_ALIGN = (5, 6, 7, 8)          # MIN_ALIGNMENT_{A,B,C,D}_BYTES
EPILOGUES = {"default": 1, "bias": 4, "gelu_aux_bias": 164, "dgelu": 192, "dgelu_bgrad": 208, "bgradb": 512}
WORKSPACE_BYTES = 32 << 20
CANDIDATES, TIMED_RUNS = 8, 3


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _find_library() -> Optional[str]:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    hits = sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcublasLt.so*"), recursive=True))
    return hits[-1] if hits else None


class _Lib:
    def __init__(self, path: str):
        self.dll = ctypes.CDLL(path)
        self.handles: Dict[int, ctypes.c_void_p] = {}
        self.plans: Dict[tuple, tuple] = {}
        self.chosen: Dict[tuple, int] = {}
        self.workspaces: Dict[Tuple[int, int], Tensor] = {}

    def call(self, name: str, *args) -> None:
        status = getattr(self.dll, name)(*args)
        if status != 0:
            raise CublasLtError(f"{name} returned cuBLAS status {status}")

    def handle(self, device: int) -> ctypes.c_void_p:
        if device not in self.handles:
            h = ctypes.c_void_p()
            self.call("cublasLtCreate", ctypes.byref(h))
            self.handles[device] = h
        return self.handles[device]

    def workspace(self, device: int, stream: int) -> Tensor:
        # one per stream: two streams running matmuls at once must not share scratch memory
        key = (device, stream)
        if key not in self.workspaces:
            self.workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
        return self.workspaces[key]

    def set_attr(self, setter: str, obj, attr: int, value: int, ctype=ctypes.c_int32) -> None:
        v = ctype(value)
        self.call(setter, obj, ctypes.c_int(attr), ctypes.byref(v), ctypes.c_size_t(ctypes.sizeof(v)))

    def layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        lay = ctypes.c_void_p()
        self.call("cublasLtMatrixLayoutCreate", ctypes.byref(lay), ctypes.c_int(dtype), ctypes.c_uint64(rows),
                  ctypes.c_uint64(cols), ctypes.c_int64(ld))
        return lay

    def plan(self, key: tuple):
        """(matmul descriptor, layouts of A, B, D, candidate algorithms) or None when cuBLASLt
        has none."""
        if key in self.plans:
            return self.plans[key]
        device, dtype, ta, tb, m, n, k, lda, ldb, ldd, epilogue, aligns = key
        desc = ctypes.c_void_p()
        self.call("cublasLtMatmulDescCreate", ctypes.byref(desc), ctypes.c_int(_COMPUTE_32F), ctypes.c_int(0))
        self.set_attr("cublasLtMatmulDescSetAttribute", desc, _DESC_TRANSA, ta)
        self.set_attr("cublasLtMatmulDescSetAttribute", desc, _DESC_TRANSB, tb)
        self.set_attr("cublasLtMatmulDescSetAttribute", desc, _DESC_EPILOGUE, EPILOGUES[epilogue])
        a = self.layout(dtype, *((k, m) if ta == _OP_T else (m, k)), lda)
        b = self.layout(dtype, *((n, k) if tb == _OP_T else (k, n)), ldb)
        d = self.layout(dtype, m, n, ldd)
        pref = ctypes.c_void_p()
        self.call("cublasLtMatmulPreferenceCreate", ctypes.byref(pref))
        self.set_attr("cublasLtMatmulPreferenceSetAttribute", pref, _PREF_MAX_WORKSPACE, WORKSPACE_BYTES,
                      ctypes.c_uint64)
        for attr, align in zip(_PREF_ALIGN, aligns):
            self.set_attr("cublasLtMatmulPreferenceSetAttribute", pref, attr, align, ctypes.c_uint32)
        results, count = (_HeuristicResult * CANDIDATES)(), ctypes.c_int(0)
        status = self.dll.cublasLtMatmulAlgoGetHeuristic(self.handle(device), desc, a, b, d, d, pref, CANDIDATES,
                                                         results, ctypes.byref(count))
        self.dll.cublasLtMatmulPreferenceDestroy(pref)
        algos = [results[i] for i in range(count.value) if results[i].state == 0] if status == 0 else []
        plan = (desc, a, b, d, algos) if algos else None
        self.plans[key] = plan
        return plan


_LIB: Optional[_Lib] = None
_LIB_SEARCHED = False


def _lib() -> Optional[_Lib]:
    global _LIB, _LIB_SEARCHED
    if not _LIB_SEARCHED:
        _LIB_SEARCHED = True
        if torch.cuda.is_available():
            torch.empty(1, device="cuda") @ torch.empty(1, device="cuda")    # torch loads cuBLAS(Lt) lazily
            path = _find_library()
            _LIB = _Lib(path) if path else None
    return _LIB


def available() -> bool:
    return _lib() is not None


def chosen_algorithms():
    """[(epilogue, m, n, k, index of the algorithm kept, candidates)] of the plans made so far
    (cuBLASLt's column-major m, n, k)."""
    lib = _LIB
    if lib is None:
        return []
    return [(key[10], key[4], key[5], key[6], i, len(lib.plans[key][4])) for key, i in lib.chosen.items()]


def _align(t: Tensor) -> int:
    p = t.data_ptr()
    a = 1
    while a < 256 and p % (a * 2) == 0:
        a *= 2
    return a


def _column_major(t: Tensor) -> Optional[Tuple[int, int]]:
    """(op, ld) of a row-major 2-D tensor [r, c] read as the column-major [c, r] (op N) or,
    when its transpose is the contiguous one, as [r, c] transposed (op T); None otherwise."""
    if t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1]):
        return _OP_N, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0]):
        return _OP_T, t.stride(1)
    return None


def mm(a: Tensor, b: Tensor, epilogue: str = "default", bias: Optional[Tensor] = None,
       aux: Optional[Tensor] = None) -> Optional[Tensor]:
    """``a @ b`` (row-major a [m, k], b [k, n], both CUDA, one dtype) with an epilogue; returns D
    [m, n] row-major, or None when cuBLASLt cannot run the request.

    * ``bias``: read by "bias" and "gelu_aux_bias" ([n], added to every row of D); written, the
      bias gradient, by "dgelu_bgrad" ([n], Σ of D over its m rows) and by "bgradb" ([m], Σ of
      ``a`` over k: in a linear's weight gradient dW = dyᵀ·x, ``a`` is dyᵀ and this is Σ dy over
      tokens);
    * ``aux`` [m, n] row-major: written by "gelu_aux_bias" (the pre-activation), read by
      "dgelu" and "dgelu_bgrad".
    """
    lib = _lib()
    dtype = _DTYPES.get(a.dtype)
    if lib is None or dtype is None or b.dtype != a.dtype or a.dim() != 2 or b.dim() != 2:
        return None
    m, k = a.shape
    n = b.shape[1]
    # column-major: Dᵀ [n, m] = bᵀ [n, k] · aᵀ [k, m]; cuBLASLt's A is our b, its B our a
    ca, cb = _column_major(b), _column_major(a)
    if ca is None or cb is None:
        return None
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    return _run(lib, dtype, ca, cb, n, m, k, b, a, out, n, epilogue, bias, aux)


def _run(lib: _Lib, dtype: int, ca, cb, m: int, n: int, k: int, A: Tensor, B: Tensor, D: Tensor, ldd: int,
         epilogue: str, bias: Optional[Tensor], aux: Optional[Tensor]) -> Optional[Tensor]:
    """cuBLASLt's column-major D [m, n] = op(A) · op(B) with ``epilogue``."""
    device = D.device.index if D.device.index is not None else torch.cuda.current_device()
    aligns = tuple(_align(t) for t in (A, B, D, D))
    key = (device, dtype, ca[0], cb[0], m, n, k, ca[1], cb[1], ldd, epilogue, aligns)
    plan = lib.plan(key)
    if plan is None:
        return None
    desc, la, lb, ld, algos = plan
    for t in (bias, aux):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            return None
    if bias is not None:
        lib.set_attr("cublasLtMatmulDescSetAttribute", desc, _DESC_BIAS_POINTER, bias.data_ptr(), ctypes.c_void_p)
    if aux is not None:
        lib.set_attr("cublasLtMatmulDescSetAttribute", desc, _DESC_AUX_POINTER, aux.data_ptr(), ctypes.c_void_p)
        lib.set_attr("cublasLtMatmulDescSetAttribute", desc, _DESC_AUX_LD, m, ctypes.c_int64)
    stream = torch.cuda.current_stream(D.device).cuda_stream
    ws = lib.workspace(device, stream)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def launch(algo):
        lib.call("cublasLtMatmul", lib.handle(device), desc, ctypes.byref(one), ctypes.c_void_p(A.data_ptr()), la,
                 ctypes.c_void_p(B.data_ptr()), lb, ctypes.byref(zero), ctypes.c_void_p(D.data_ptr()), ld,
                 ctypes.c_void_p(D.data_ptr()), ld, ctypes.byref(algo.algo), ctypes.c_void_p(ws.data_ptr()),
                 ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream))
    if key not in lib.chosen:
        if torch.cuda.is_current_stream_capturing():     # no timing (it syncs) inside a CUDA graph
            launch(algos[0])
            return D
        lib.chosen[key] = _fastest(launch, algos) if len(algos) > 1 else 0
    launch(algos[lib.chosen[key]])
    return D


def _fastest(launch, algos) -> int:
    """Index of the fastest of ``algos`` on this call's operands (each launched once to warm
    up, then ``TIMED_RUNS`` times between CUDA events); a candidate that fails is skipped."""
    times = []
    for algo in algos:
        try:
            launch(algo)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(TIMED_RUNS):
                launch(algo)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        except CublasLtError:
            times.append(float("inf"))
    return min(range(len(algos)), key=times.__getitem__)
