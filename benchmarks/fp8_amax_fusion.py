"""Where the FP8 amaxes run under ``compile=True``, one GPU: every kernel of one profiled
training step whose inductor name holds ``vector_norm`` (the amax: ``ops.fp8._amax``), with
what inductor fused into it (its name lists the fused ops: ``rsqrt``/``mean`` is a norm,
``silu``/``mul`` the SwiGLU product, ``native_layer_norm`` a LayerNorm), its launches and time,
next to the step's FP8 casts (``_cast_kernel``), GEMMs and the rest.

    python benchmarks/fp8_amax_fusion.py [--model hf-llama1b] [--layers 2] [--recipe tensorwise]

An amax fused with its producer reads no extra tensor; one alone ("vector_norm" and nothing
else in its name) reads the activation once more.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxmegatron                                     # noqa: E402
from e2e.models import MODEL_NAMES, build_spec            # noqa: E402


def kind(name: str) -> str:
    n = name.lower()
    if "vector_norm" in n:
        rest = n.replace("triton_", "").replace("vector_norm", "").replace("linalg", "")
        fused = [w for w in ("rsqrt", "mean", "layer_norm", "silu", "gelu", "mul", "add", "view", "clone") if w in rest]
        return "amax fused with " + "+".join(fused) if fused else "amax alone"
    if "_cast_kernel" in n:
        return "FP8 cast (ours)"
    if any(w in n for w in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "matmul"
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="hf-llama1b", choices=MODEL_NAMES)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--recipe", default="tensorwise")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_amax_fusion: needs a CUDA GPU (sm_89+)")
    spec = build_spec(argparse.Namespace(hf_config="", model=args.model, tiny=False, vocab=None, seq=None,
                                         global_batch=None, layers=args.layers, hidden=None, heads=None))
    batch = spec.make_batch("cuda")
    pm = fxmegatron.parallelize(spec.plain("cuda", torch.bfloat16), None, batch, precision="fp8",
                                fp8_recipe=args.recipe, compile=True)

    def step():
        out = pm(batch)
        (out[0] if isinstance(out, (tuple, list)) else out).backward()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind, by_name = defaultdict(float), defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            by_kind[kind(e.name)] += us
            by_name[e.name][0] += 1
            by_name[e.name][1] += us
    total = sum(by_kind.values())
    print(f"{args.model}, {args.layers} layers, fp8 {args.recipe}, compile=True: {total / 1e3:.2f} ms of kernels")
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {us / 1e3:8.2f} ms  {100 * us / total:5.1f}%")
    print("kernels holding an amax:")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        if "vector_norm" in name:
            print(f"  {us / 1e3:7.3f} ms  x{n:<3d} {name[:150]}")
    print(f"top {args.top} kernels:")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {us / 1e3:7.3f} ms  x{n:<3d} {name[:150]}")


if __name__ == "__main__":
    main()
