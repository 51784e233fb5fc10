"""Step time and peak memory of the bundled GPT per recompute mode, next to eager PyTorch.

One process, one GPU (or CPU for a smoke run). Default: the gpt1.3b config of
Korthikanti et al. 2022 (24 layers, h 2048, 16 heads, s 2048, V 50304, micro-batch 8),
bf16 weights and AdamW, dropout 0, tied embeddings.

    python benchmarks/recompute_gpt.py                      # on a GPU
    python benchmarks/recompute_gpt.py --tiny --device cpu  # smoke run

A step = forward + backward + AdamW step. Model FLOPs per step (no recompute counted):
72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)). MFU against the dense bf16 peak given by --peak-tflops.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpt import GPT, GPTConfig  # noqa: E402

import fxmegatron  # noqa: E402


def model_flops(b, s, l, h, v):
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(step, dev, warmup, steps):
    for _ in range(warmup):
        step()
    _sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run_mode(mode, cfg, args, dev, mesh):
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size), generator=gen).to(dev)
    labels = torch.randint(0, cfg.vocab_size, (args.micro_batch, cfg.block_size), generator=gen).to(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    if mode == "eager":
        with torch.device(dev):
            model = GPT(cfg).to(dtype)
        fn = model
    else:
        with torch.device("meta"):
            model = GPT(cfg).to(dtype)
        fn = fxmegatron.parallelize(model, mesh, (ids, labels), recompute=mode)
    t_build = time.perf_counter() - t_build
    opt = torch.optim.AdamW(fn.parameters(), lr=1e-4, fused=dev.type == "cuda")
    losses = []

    def step():
        loss = fn(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    t = _time_steps(step, dev, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    flops = model_flops(args.micro_batch, cfg.block_size, cfg.n_layer, cfg.n_embd, cfg.vocab_size)
    row = {"mode": mode, "step_s": t, "tokens_per_s": args.micro_batch * cfg.block_size / t,
           "tflops": flops / t / 1e12, "mfu": flops / t / 1e12 / args.peak_tflops, "peak_gib": peak,
           "build_s": t_build, "loss_first": losses[0].item(), "loss_last": losses[-1].item()}
    del fn, model, opt, losses
    gc.collect()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="eager,none,selective,full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100/H200 SXM: 989)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, h 64, s 64, V 512, micro-batch 2")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.seq, args.vocab, args.micro_batch = 2, 64, 4, 64, 512, 2
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.hidden, dropout=0.0, tie_embeddings=True)
    dev = torch.device(args.device)
    mesh = None
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    rows = []
    for mode in args.modes.split(","):
        try:
            rows.append(run_mode(mode, cfg, args, dev, mesh))
        except torch.OutOfMemoryError as exc:
            rows.append({"mode": mode, "error": "out of memory: " + str(exc).splitlines()[0][:80]})
            gc.collect()
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nGPT l={args.layers} h={args.hidden} a={args.heads} s={args.seq} V={args.vocab} "
          f"B={args.micro_batch} {args.dtype} on {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}")
    print(f"{'mode':10} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'loss':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:10} {r['error']}")
            continue
        print(f"{r['mode']:10} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:10.0f} {r['tflops']:8.1f} "
              f"{r['mfu'] * 100:5.1f}% {r['peak_gib']:9.2f} {r['loss_first']:6.3f}->{r['loss_last']:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
