"""The attention block kernels of context parallelism, one GPU: each fused kernel fxmegatron's
``cp_attention`` can call (``fxmegatron.ops.attention_blocks.KERNELS``), with the kv heads as
they are and repeated, against SDPA's own choice, at the block shapes of a cp2 step.

    python benchmarks/cp_blocks.py --seq 65536 --json blocks.json     # one GPU
    python benchmarks/cp_blocks.py --pick                              # print the fastest order

Shapes: Llama-3-8B's attention (32 heads, 8 kv heads, dim 128), bf16, batch 1; at sequence s
and cp 2 a rank's shard is 2c tokens, c = s/4: its own block is 2c queries against its 2c keys
under the causal mask, the other is c queries against 2c keys, full. First each kernel's
(out, lse, dq, dk, dv) against fp32 math at s 1024 (max error relative to the largest value);
then the median time of --reps forward and backward calls (CUDA events), TFLOP/s counting the
causal half only: 4·Sq·Sk·H·d per forward (2 for QKᵀ, 2 for ·V), 2.5× that backward.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxmegatron.ops import attention_blocks as ab  # noqa: E402

H, HKV, D = 32, 8, 128


def tensors(sq, sk, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q, dout = (torch.randn(1, H, sq, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, HKV, sk, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, dout


def variants():
    """name -> (forward, backward) callables on (q, k, v[, ...]); '-repeat': kv heads repeated."""
    out = {}
    for name in ab.KERNELS:
        fwd, bwd = ab._FORWARD[name], ab._BACKWARD[name]
        out[name] = (fwd, bwd)

        def rf(q, k, v, _f=fwd, **kw):
            g = q.shape[1] // k.shape[1]
            return _f(q, ab._expand(k, g), ab._expand(v, g), **kw)

        def rb(dout, q, k, v, o, lse, _b=bwd, **kw):
            g = q.shape[1] // k.shape[1]
            dq, dk, dv = _b(dout, q, ab._expand(k, g), ab._expand(v, g), o, lse, **kw)
            return (dq,) + ab._fold_heads(dk, dv, k.shape[1])
        out[name + "-repeat"] = (rf, rb)
    return out


def check(name, fwd, bwd, dev):
    q, k, v, dout = tensors(1024, 1024, dev, seed=1)
    errs = {}
    for causal in (True, False):
        o, lse = fwd(q, k, v, causal=causal, scale=D ** -0.5)
        ro, rlse = ab._math_forward(q, k, v, causal=causal, scale=D ** -0.5)
        got = bwd(dout, q, k, v, o, lse, causal=causal, scale=D ** -0.5)
        ref = ab._math_backward(dout, q, k, v, o, lse, causal=causal, scale=D ** -0.5)
        for key, a, b in [("out", o, ro), ("lse", lse, rlse), ("dq", got[0], ref[0]), ("dk", got[1], ref[1]),
                          ("dv", got[2], ref[2])]:
            assert tuple(a.shape) == tuple(b.shape), (name, key, a.shape, b.shape)
            e = ((a.float() - b).abs().max() / b.abs().max().clamp_min(1)).item()
            errs[key] = max(errs.get(key, 0.0), e)
    return errs


def timed(fn, reps):
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times[1:])[reps // 2]


def sdpa_kernel_names(q, k, v):
    from torch.profiler import ProfilerActivity, profile
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    return sorted(n[:80] for n in names if any(w in n.lower() for w in ("flash", "fmha", "cudnn", "attention", "sm90")))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--pick", action="store_true", help="print only the kernel order to use, fastest first")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    c = args.seq // 4
    shapes = {"own 2c causal": (2 * c, 2 * c, True), "other c x 2c full": (c, 2 * c, False)}
    rows = []
    for name, (fwd, bwd) in variants().items():
        row = {"kernel": name}
        try:
            row["errors"] = check(name, fwd, bwd, dev)
            for label, (sq, sk, causal) in shapes.items():
                q, k, v, dout = tensors(sq, sk, dev)
                kw = dict(causal=causal, scale=D ** -0.5)
                o, lse = fwd(q, k, v, **kw)
                o = o.to(q.dtype)
                f_ms = timed(lambda: fwd(q, k, v, **kw), args.reps)
                b_ms = timed(lambda: bwd(dout, q, k, v, o, lse, **kw), args.reps)
                flops = 4 * sq * sk * H * D * (0.5 if causal else 1.0)
                row[label] = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_tflops": flops / f_ms / 1e9,
                              "bwd_tflops": 2.5 * flops / b_ms / 1e9}
                del q, k, v, dout, o, lse
        except Exception as exc:      # noqa: BLE001 -- a kernel that fails is a row, not the end
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        torch.cuda.empty_cache()
    q, k, v, _ = tensors(2 * c, 2 * c, dev)
    q.requires_grad_()
    sdpa = {"kernels": sdpa_kernel_names(q, k, v)}
    ok = [r for r in rows if "error" not in r and not r["kernel"].endswith("-repeat")
          and max(r["errors"].values()) < 2e-2]
    total = {r["kernel"]: sum(r[s]["fwd_ms"] + r[s]["bwd_ms"] for s in shapes) for r in ok}
    order = sorted(total, key=total.get)
    if args.pick:
        print(",".join(order or ["flash"]))
        return 0
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; s {args.seq}, cp2 blocks, c {c}; H {H}, Hkv {HKV}, "
          f"d {D}, bf16; median of {args.reps}")
    print(f"SDPA(is_causal, enable_gqa) runs: {sdpa['kernels']}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:14} error: {r['error']}")
            continue
        errs = " ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
        parts = "; ".join(f"{s}: fwd {r[s]['fwd_ms']:.2f} ms ({r[s]['fwd_tflops']:.0f} TF/s), bwd {r[s]['bwd_ms']:.2f} ms "
                          f"({r[s]['bwd_tflops']:.0f} TF/s)" for s in shapes)
        print(f"{r['kernel']:14} {parts}\n{'':14} max rel. error vs fp32 math: {errs}")
    print(f"order (correct kernels, fastest first): {','.join(order)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": args.seq,
                       "rows": rows, "sdpa": sdpa, "order": order}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
