"""Sequence parallelism's overlapped linears, one op at a time, on gpt6.7b's tp4 shapes.

    torchrun --standalone --nproc-per-node 4 benchmarks/tp_overlap_ops.py [--batch 16 --seq 2048 --hidden 4096]

What the end-to-end table cannot say: how long each merged op (``fxmegatron.ops.overlapped_linear``)
takes against its matmuls alone, forward and backward, for each transport and number of
pieces; and how fast the copy engines pull from a peer (one stream, or one per peer).

* Copies: 64 MiB pulled from symmetric buffers with ``copy_engine.copy2d``: from one peer; from
  every peer on one stream; from every peer on a stream each; and the 2-D pattern of a
  gather's sequence slices ([batch] blocks). GB/s per rank.
* Ops: the attention's qkv and the MLP's fc1 (all-gather, then linear), the attention's
  projection and fc2 (linear, then reduce-scatter), bf16, each rank its own random inputs.
  "matmuls alone": the same products with no communication (a rank's share of the work,
  unsplit). "nccl:N": over NCCL in N batch pieces; "ce": over copy engines, round the ranks'
  sequence slices. Each row: ms forward, ms backward, the excess over the matmuls alone, and
  the largest difference of the output and gradients from the first transport's (relative
  to the largest value; bf16, so about 1e-2 where sums run in another order). Times: CUDA
  events around --iters calls after --warmup, rank 0's (the ranks wait for each other inside
  every op).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


def timed(fn, warmup, iters):
    """ms per call of ``fn`` (events around ``iters`` calls, after a barrier)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def copy_bandwidths(group_name, pg, rank, world, args):
    from fxmegatron.ops import copy_engine

    nbytes = 64 << 20
    ws = copy_engine.workspace(group_name, pg, nbytes, torch.device("cuda"))
    dst = torch.empty(world, nbytes, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(world)]
    main = torch.cuda.current_stream()

    def pull(peers, nstreams, height=1):
        def run():
            for s in streams[:nstreams]:
                s.wait_stream(main)
            for i, q in enumerate(peers):
                w = nbytes // height
                b = copy_engine.Blocks(0, w, 0, w, w, height)
                copy_engine.copy2d(dst[q], ws.view(q, nbytes, torch.uint8), b, streams[i % nstreams])
            for s in streams[:nstreams]:
                main.wait_stream(s)
        return run

    def push(peers):
        def run():
            s = streams[0]
            s.wait_stream(main)
            for q in peers:
                b = copy_engine.Blocks(0, nbytes, 0, nbytes, nbytes, 1)
                copy_engine.copy2d(ws.view(q, nbytes, torch.uint8), dst[q], b, s)
            main.wait_stream(s)
        return run

    peers = [(rank + i) % world for i in range(1, world)]
    rows = []
    for label, peers_ in (("push to one peer", peers[:1]), ("push to every peer, one stream", peers)):
        rows.append((label, len(peers_) * nbytes / timed(push(peers_), args.warmup, args.iters) / 1e6))
    for label, peers_, n, h in (("one peer", peers[:1], 1, 1), ("every peer, one stream", peers, 1, 1),
                                ("every peer, a stream each", peers, len(peers), 1),
                                (f"every peer, a stream each, {args.batch} blocks", peers, len(peers), args.batch),
                                ("this rank's own buffer", [rank], 1, 1)):
        ms = timed(pull(peers_, n, h), args.warmup, args.iters)
        rows.append((label, len(peers_) * nbytes / ms / 1e6))
    return rows


def _config(c):
    """(transport, pieces) of a --configs entry."""
    name, _, k = c.partition(":")
    if name == "nccl":
        return "nccl", int(k or 1)
    if name == "ce":
        return "copy_engine", 1
    raise SystemExit(f"--configs: unknown entry {c!r}")


def op_rows(group_name, world, args):
    from fxmegatron.ops.overlapped_linear import gathered_linears, scattered_linear

    B, S, H = args.batch, args.seq, args.hidden
    s = S // world
    dt = getattr(torch, args.dtype)
    torch.manual_seed(dist.get_rank())     # every rank its own inputs, so the reductions sum different numbers
    ops = {   # name: (kind, input shape, weight (out, in), bias)
        "qkv": ("gather", (B, s, H), (3 * H // world, H), True),
        "fc1": ("gather", (B, s, H), (4 * H // world, H), True),
        "proj": ("scatter", (B, S, H // world), (H, H // world), False),
        "fc2": ("scatter", (B, S, 4 * H // world), (H, 4 * H // world), False),
    }
    ops["q, k, v"] = ("gather", (B, s, H), (H // world, H), True)     # three linears of one input
    if args.no_bias_row:
        ops["qkv, no bias"] = ("gather", (B, s, H), (3 * H // world, H), False)
    configs = [("matmuls alone", None, 1)] + [(c, *_config(c)) for c in args.configs.split(",")]
    rows = []
    for name, (kind, xshape, wshape, has_bias) in ops.items():
        x = torch.randn(xshape, device="cuda", dtype=dt, requires_grad=True)
        n_lin = 3 if name == "q, k, v" else 1
        w = (torch.randn((n_lin,) + wshape, device="cuda", dtype=dt) * 0.02).requires_grad_()
        b = (torch.randn(n_lin, wshape[0], device="cuda", dtype=dt) * 0.02).requires_grad_() if has_bias else None
        base, ref = None, None
        for label, transport, k in configs:
            if transport is None:
                full = (B, S, xshape[-1]) if kind == "gather" else xshape
                xa = torch.randn(full, device="cuda", dtype=dt, requires_grad=True)

                def fwd():
                    return sum((i + 1) * torch.nn.functional.linear(xa, w[i], None if b is None else b[i])
                               for i in range(n_lin))
            elif kind == "gather":
                def fwd():
                    outs = gathered_linears(x, list(w.unbind(0)), [None] * n_lin if b is None else list(b.unbind(0)),
                                            1, world, group_name, k, transport)
                    return sum((i + 1) * o for i, o in enumerate(outs))     # distinct gradients per linear
            else:
                def fwd():
                    return scattered_linear(x, w[0], 1, world, group_name, k, transport)
            y = fwd()
            g = torch.randn_like(y, generator=torch.Generator("cuda").manual_seed(1))

            def bwd():
                torch.autograd.backward(y, g, retain_graph=True)

            if transport is not None:   # the numbers, against the first transport's
                for t in (x, w, b):
                    if t is not None:
                        t.grad = None
                bwd()
                got = [y.detach().float().clone()] + [t.grad.float().clone() for t in (x, w, b) if t is not None]
                if ref is None:
                    ref = got
                err = max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(got, ref))

            f_ms = timed(fwd, args.warmup, args.iters)
            b_ms = timed(bwd, args.warmup, args.iters)
            if base is None:
                base = (f_ms, b_ms)
            rows.append((name, label, f_ms, b_ms, f_ms - base[0], b_ms - base[1],
                         "" if transport is None else f"{err:.1e}"))
            for t in (x, w, b):
                if t is not None:
                    t.grad = None
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--configs", default="nccl:1,nccl:4,ce",
                    help="comma-separated: nccl:PIECES (NCCL, batch pieces), ce (copy engines, the ranks' sequence "
                         "slices)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--no-bias-row", action="store_true", help="also time qkv without its bias")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tp_overlap_ops.py needs CUDA GPUs: none here, nothing timed.")
        return 0
    from fxmegatron.runtime.distributed import init_from_env
    env = init_from_env("cuda")
    rank, world = env.rank, env.world
    pg = dist.group.WORLD
    group_name = pg.group_name
    bw = copy_bandwidths(group_name, pg, rank, world, args)
    rows = op_rows(group_name, world, args)
    if rank == 0:
        print(f"\n{world} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
              f"batch {args.batch}, seq {args.seq}, hidden {args.hidden}, bf16\n")
        print("| copy (64 MiB to or from each) | GB/s per rank |\n|---|---:|")
        for label, gbs in bw:
            print(f"| {label} | {gbs:.0f} |")
        print("\n| op | how | fwd ms | bwd ms | fwd excess | bwd excess | max rel. diff |\n"
              "|---|---|---:|---:|---:|---:|---:|")
        for name, label, f, b, fe, be, err in rows:
            print(f"| {name} | {label} | {f:.3f} | {b:.3f} | {fe:+.3f} | {be:+.3f} | {err} |")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
