"""One more step under torch.profiler on rank 0, and its breakdown from the GPU kernels:
compute (the union of non-NCCL kernels), exposed communication (an NCCL collective and no
compute), bubble (NCCL send/recv and no compute) and idle (no kernel); and where the kernel
time goes by kind of work (``WORK``, from kernel names: a kernel's summed duration, so
kernels that run side by side on two streams count twice); and the SDPA backend the step's
attention ran on (``sdpa_backend``, from the op and kernel names, CPU runs too)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, Optional

import torch
import torch.distributed as dist

STEP_MARK = "end_to_end_step"     # the profiler annotation around the profiled step


def sync(dev):
    """Wait for the GPU (nothing on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ---- unions of kernel intervals ----------------------------------------------------------------
def merge(intervals):
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(intervals):
    return sum(e - s for s, e in merge(intervals))


def minus(a, b):
    """The parts of the union of ``a`` that the union of ``b`` does not cover."""
    a, b = merge(a), merge(b)
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        cur, k = s, j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append([cur, b[k][0]])
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append([cur, e])
    return out


def kernel_class(name: str) -> str:
    """"collective", "p2p" or "compute" for a GPU kernel name."""
    n = name.lower()
    if "nccl" not in n:
        return "compute"
    if any(w in n for w in ("sendrecv", "send", "recv")):
        return "p2p"
    return "collective"     # AllReduce, AllGather, ReduceScatter, Broadcast, ...


# kind of work -> words in the kernel names (lower case; the first kind that matches wins).
# Inductor and fxmegatron name a fused kernel after its ops: a norm's has rsqrt forward and
# pow + sum backward; ce_fwd/ce_bwd are fxmegatron's cross-entropy.
WORK = (("communication", ("nccl",)),
        ("optimizer", ("adamw", "multi_tensor", "foreach", "reduce_kernel")),
        ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn", "dot_do_o")),
        ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
        ("loss", ("ce_fwd", "ce_bwd", "nll_loss", "log_softmax", "cross_entropy", "softmax")),
        ("norm", ("rsqrt", "layer_norm", "rms_norm")),
        ("copy", ("memcpy", "memset", "copy_kernel", "fillfunctor", "catarray")))


def work_kind(name: str) -> str:
    n = name.lower()
    if "pow" in n and "sum" in n and "triton" in n:
        return "norm"
    for kind, words in WORK:
        if any(w in n for w in words):
            return kind
    return "elementwise"


# SDPA's backends, in the order printed. Named from the aten ops on the profile's CPU side and the
# GPU kernels, since a replayed CUDA graph shows kernels only and a CPU run ops only.
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "cpu-flash", "math")


def sdpa_backend_of(name: str) -> Optional[str]:
    """The SDPA backend an op or kernel name belongs to, or None."""
    n = name.lower()
    if "cudnn" in n and ("attention" in n or "sdpa" in n):
        return "cudnn"      # checked first: cuDNN's kernels are named *_sdpa_*_flash_fprop_*
    if "flash_attention_for_cpu" in n:
        return "cpu-flash"
    if any(w in n for w in ("flash_fwd", "flash_bwd", "flash_attention")):
        return "flash"
    if any(w in n for w in ("efficient_attention", "fmha_cutlass", "mem_eff")):
        return "efficient"
    if "_scaled_dot_product_attention_math" in n:
        return "math"
    return None


def sdpa_backend(names) -> str:
    """The backends the names show ("cudnn+flash": forward and backward on different ones);
    "math" for fxmegatron's attention op with no fused kernel under it (its fallback); "none seen"
    where nothing names SDPA (no attention, or a compiler decomposed it into matmuls)."""
    names = list(names)
    found = {sdpa_backend_of(n) for n in names} - {None}
    if found:
        return "+".join(b for b in SDPA_BACKENDS if b in found)
    if any("fxmegatron::attention" in n for n in names):
        return "math"
    return "none seen"


def breakdown(trace_events) -> Optional[Dict[str, float]]:
    """Compute / exposed communication / bubble / idle, in ms, of the step marked STEP_MARK
    in a chrome trace's events; None without GPU kernels (a CPU run)."""
    marks = [e for e in trace_events if e.get("name") == STEP_MARK and e.get("ph") == "X"
             and e.get("cat") == "user_annotation"]
    if not marks:
        return None
    w0 = float(marks[0]["ts"])
    w1 = w0 + float(marks[0]["dur"])
    by_class = {"compute": [], "collective": [], "p2p": []}
    work: Dict[str, float] = {}
    for e in trace_events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        s, t = max(float(e["ts"]), w0), min(float(e["ts"]) + float(e.get("dur", 0)), w1)
        if t > s:
            by_class[kernel_class(e.get("name", "")) if e["cat"] == "kernel" else "compute"].append((s, t))
            kind = work_kind(e.get("name", "") if e["cat"] == "kernel" else "memcpy")
            work[kind] = work.get(kind, 0.0) + (t - s) * 1e-3
    every = by_class["compute"] + by_class["collective"] + by_class["p2p"]
    if not every:
        return None
    ms = 1e-3    # trace times are in microseconds
    return {"step_ms_profiled": (w1 - w0) * ms,
            "compute_ms": length(by_class["compute"]) * ms,
            "exposed_comm_ms": length(minus(by_class["collective"], by_class["compute"])) * ms,
            "bubble_ms": length(minus(by_class["p2p"], by_class["compute"])) * ms,
            # any NCCL kernel and no compute: what benchmarks/context_parallel.py reports, where P2P
            # is the attention ring's, not a pipeline's (its collectives and P2P may overlap each other)
            "exposed_any_comm_ms": length(minus(by_class["collective"] + by_class["p2p"], by_class["compute"])) * ms,
            "idle_ms": ((w1 - w0) - length(every)) * ms,
            "work_ms": dict(sorted(work.items(), key=lambda kv: -kv[1]))}


def profiled_step(step, lay, args, dev, rank):
    """One more step; rank 0 runs it under torch.profiler, writes the trace and returns the breakdown
    (none on CPU) and ``sdpa_backend``.
    With ``--profile-dir`` every rank runs it under the profiler and writes its trace (to see
    which rank another waits for); rank 0's breakdown is still the one returned."""
    if rank != 0 and not args.profile_dir:
        sync(dev)
        dist.barrier()
        step()
        sync(dev)
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as p:
        sync(dev)
        dist.barrier()
        with record_function(STEP_MARK):
            step()
            sync(dev)
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        path = os.path.join(args.profile_dir, f"{lay.name}.rank{rank}.json")
        p.export_chrome_trace(path)
        if rank != 0:
            return None
    else:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        p.export_chrome_trace(path)
    try:
        with open(path) as f:
            trace = json.load(f)
    finally:
        if not args.profile_dir:
            os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = dict(breakdown(events) or {}, sdpa_backend=sdpa_backend(e.get("name", "") for e in events))
    if args.profile_dir:
        out["trace"] = path
    return out
