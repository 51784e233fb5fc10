"""Generated elementwise kernels against eager PyTorch and torch.compile, bf16, on one GPU.

    python benchmarks/fused_kernels.py [--sweep] [--graphs] [--trials K] [--no-hints-too] [--only CHAIN]

Shapes: gpt1.3b (micro-batch 8, s 2048, h 2048, 16 heads): bias + GeLU (tanh and erf) on
the MLP's 4h, bias + dropout(0.1) + residual on h, scale + mask on the attention scores;
Llama-3-8B (s 2048, 32 heads of 128, MLP 14336): SiLU·mul and the rotary embedding of q.
Times are medians of triton.testing.do_bench. Each chain without dropout is also run in
fp32 and its outputs and input gradients compared with eager's. Bandwidth counts the fewest bytes each pass
must move (every input read once, every output written once; in backward the saved
inputs and the incoming gradient read, the input gradients written) against a measured
device-to-device copy. ``--sweep`` also times other tile shapes and prints the best.
``--graphs`` adds a second fwd+bwd row per chain timed by replaying a CUDA graph of the step
(``triton.testing.do_bench_cudagraph``): the GPU time of each version's kernels, without
the Python autograd and launch time that bounds the smaller chains' ordinary row.
``--trials K`` takes each time as the median of K rounds in which the versions take turns.
``--no-hints-too`` times the fused kernels once more without their eviction hints.
"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from fxmegatron.codegen.patterns import REFERENCE_CHAINS  # noqa: E402
from fxmegatron.codegen.chain_source import BCAST, FULL, KEY, ROW  # noqa: E402
from fxmegatron.codegen.fused_chain import FusedChain, tiles  # noqa: E402

B, S = 8, 2048
# (label, reference chain, output shape)
CASES = [("gpt1.3b bias+GeLU(tanh)", "bias_gelu_tanh", (B * S, 8192)),
         ("gpt1.3b bias+GeLU(erf)", "bias_gelu_erf", (B * S, 8192)),
         ("gpt1.3b bias+drop+resid", "bias_dropout_residual", (B * S, 2048)),
         ("gpt1.3b scale+mask", "scale_mask_fill", (B, 16, S, S)),
         ("llama8b SiLU*mul", "swiglu", (B * S, 14336)),
         ("llama8b rotary q", "rotary", (B, 32, S, 128))]
SWEEP = [(tile // bn, bn, w) for bn in (64, 128, 256, 512, 1024) for tile in (1024, 2048, 4096, 8192) for w in (2, 4, 8)
         if tile >= bn]
# chains of full-shape inputs run as one row of all their elements (``FusedChain.flat``)
FLAT_SWEEP = [(1, bn, w) for bn in (512, 1024, 2048, 4096, 8192) for w in (2, 4, 8)]


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def medians(fns, timer, trials):
    """Each fn's median time over ``trials`` rounds, the fns taking turns within a round (so a
    drift in clock or temperature falls on all of them alike)."""
    runs = [[] for _ in fns]
    for _ in range(trials):
        for r, fn in zip(runs, fns):
            r.append(timer(fn))
    return [None if None in r else sorted(r)[len(r) // 2] for r in runs]


def bench_graph(fn):
    """ms per replay of a CUDA graph of ``fn`` (captured after warm-up calls); None where the
    step cannot be captured (a host sync inside, say)."""
    from triton.testing import do_bench_cudagraph
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:       # report, do not stop the table
        print(f"    (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        return None


def fp32_error(ref, fused, shape, dev, gen):
    """Largest |fused - eager| over forward and input gradients, both in fp32 (relative to
    each tensor's largest magnitude); None for chains with dropout (their masks differ)."""
    if KEY in ref.kinds:
        return None
    xs = ref.inputs(shape, torch.float32, dev, generator=gen)
    outs = []
    for f in (fused.apply, ref.eager):
        ins = [x.detach().clone().requires_grad_() if k in (FULL, ROW) else x for x, k in zip(xs, ref.kinds)]
        y = f(*ins)
        y.backward(torch.ones_like(y))
        outs.append([y.detach()] + [x.grad for x in ins if isinstance(x, torch.Tensor) and x.requires_grad])
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(*outs))


def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="chains whose key contains one of these (a comma list)")
    ap.add_argument("--graphs", action="store_true", help="also time fwd+bwd as CUDA graph replays")
    ap.add_argument("--trials", type=int, default=1,
                    help="time each version this many times in turn and take the median")
    ap.add_argument("--no-hints-too", action="store_true",
                    help="also time the fused kernels without their eviction hints (an A/B row)")
    args = ap.parse_args()
    dev = "cuda"
    big = torch.empty(2**28, dtype=torch.bfloat16, device=dev).normal_()
    out = torch.empty_like(big)
    t = bench(lambda: out.copy_(big))
    copy_bw = 2 * big.numel() * 2 / (t * 1e-3) / 1e9
    del big, out
    print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write)\n", flush=True)
    print(f"{'chain':26s} {'pass':8s} {'eager ms':>9s} {'compile ms':>10s} {'fused ms':>9s} "
          f"{'fused GB/s':>10s} {'% copy':>7s} {'vs compile':>10s}")
    gen = torch.Generator().manual_seed(0)
    for label, key, shape in CASES:
        if args.only and not any(o and o in key for o in args.only.split(",")):
            continue
        ref = REFERENCE_CHAINS[key]
        fused = FusedChain(ref.chain, ref.kinds)
        xs = ref.inputs(shape, torch.bfloat16, dev, generator=gen)
        xs = [x.requires_grad_() if k in (FULL, ROW) else x for x, k in zip(xs, ref.kinds)]
        g = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        compiled = torch.compile(ref.eager)
        data = [x for x, k in zip(xs, ref.kinds) if k != KEY]
        fwd_bytes = nbytes(data) + nbytes([g])
        bwd_bytes = nbytes(data) + nbytes([g]) + nbytes([x for x in xs if x.requires_grad])
        with torch.no_grad():
            te, tc, tf = medians([lambda: ref.eager(*xs), lambda: compiled(*xs), lambda: fused.forward(*xs)],
                                 bench, args.trials)
        print(f"{label:26s} {'forward':8s} {te:9.4f} {tc:10.4f} {tf:9.4f} {fwd_bytes / tf / 1e6:10.0f} "
              f"{fwd_bytes / tf / 1e6 / copy_bw * 100:6.0f}% {tc / tf:9.3f}x", flush=True)

        def step(f):
            def run():
                y = f(*xs)
                y.backward(g)
                for x in xs:
                    x.grad = None
            return run
        te, tc, tf = medians([step(ref.eager), step(compiled), step(fused.apply)], bench, args.trials)
        both = fwd_bytes + bwd_bytes
        print(f"{label:26s} {'fwd+bwd':8s} {te:9.4f} {tc:10.4f} {tf:9.4f} {both / tf / 1e6:10.0f} "
              f"{both / tf / 1e6 / copy_bw * 100:6.0f}% {tc / tf:9.3f}x", flush=True)
        if args.graphs:
            te, tc, tf = medians([step(ref.eager), step(compiled), step(fused.apply)], bench_graph, args.trials)
            if None not in (te, tc, tf):
                print(f"{label:26s} {'graphed':8s} {te:9.4f} {tc:10.4f} {tf:9.4f} {both / tf / 1e6:10.0f} "
                      f"{both / tf / 1e6 / copy_bw * 100:6.0f}% {tc / tf:9.3f}x", flush=True)
        if args.no_hints_too:
            fused.keep_reused = False
            with torch.no_grad():
                tn = bench(lambda: fused.forward(*xs))
            tg = bench_graph(step(fused.apply)) if args.graphs else bench(step(fused.apply))
            fused.keep_reused = True
            print(f"{'':26s} no eviction hints: forward {tn:.4f} ms ({fwd_bytes / tn / 1e6 / copy_bw:.0%} of copy), "
                  f"fwd+bwd{' graphed' if args.graphs else ''} {'n/a' if tg is None else f'{tg:.4f}'} ms", flush=True)
        err = fp32_error(ref, fused, (max(1, shape[0] // 8),) + shape[1:], dev, gen)
        if err is not None:
            print(f"{'':26s} fp32 fwd+bwd vs eager: max error {err:.1e} (relative to each tensor's max)", flush=True)
        if args.sweep:
            n = shape[-1]
            res = {}
            for bwd in (False, True):
                best = None
                for cfg in (FLAT_SWEEP if fused.flat else SWEEP):
                    if not fused.flat and cfg[1] > 2 * n:
                        continue
                    if bwd:
                        fused.bwd_tiles = cfg
                        ys = xs
                        tt = bench(lambda: fused.backward(ys, [g], [x.requires_grad for x in xs]))
                    else:
                        fused.fwd_tiles = cfg
                        with torch.no_grad():
                            tt = bench(lambda: fused.forward(*xs))
                    if best is None or tt < best[0]:
                        best = (tt, cfg)
                fused.fwd_tiles = fused.bwd_tiles = None
                with torch.no_grad():
                    dflt = bench(lambda: fused.backward(xs, [g], [x.requires_grad for x in xs])) if bwd \
                        else bench(lambda: fused.forward(*xs))
                res["bwd" if bwd else "fwd"] = (best, dflt, tiles(n, bwd, ROW in ref.kinds, fused.flat, BCAST in ref.kinds,
                                                                  bool(ref.chain.rotated)))
            for k, ((tb, cfg), dflt, d_cfg) in res.items():
                print(f"    sweep {k}: best {cfg} {tb:.3f} ms; default {d_cfg} {dflt:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
