"""Sibling linears (one input, several weights) as separate matmuls or as one, bf16, one GPU.

    python benchmarks/merged_linears.py [--eager]

A transformer's q, k and v projections (and a gated MLP's gate and up) read the same
activation. Run apart, the forward is three matmuls and the backward three dgrad matmuls
whose results are summed. Run as one, the weights are concatenated each step, one matmul
computes every output, and the backward concatenates the outputs' gradients for one dgrad
and one wgrad matmul. Each row times forward + backward (median of triton.testing.do_bench)
under torch.compile (or eager with --eager), at the shapes of the end-to-end benchmark's
models; TFLOP/s counts 6·M·K·ΣN.

Read with care: at the small shapes (the q, k, v of the 1B models) a row is one compiled
function called alone, and its host work (guards, autograd, the leaves' gradients) takes longer
than its kernels: rows near 100-250 TFLOP/s time the host, not the GEMMs (one H200, torch 2.11:
the Qwen2 q/k/v rows ran 1.5 ms for about 0.3 ms of kernels). Session 17 read "not worth having"
off such rows; inside a whole compiled training step the merge pays where a member is narrow
(``passes/merge_linears.py``, docs/COMPILE.md).
"""
import argparse

import torch
import torch.nn.functional as F

SHAPES = [  # label, tokens, in features, out features of each sibling, bias
    ("gpt1.3b qkv", 16384, 2048, (2048, 2048, 2048), True),
    ("llama1b qkv", 8192, 2048, (2048, 512, 512), False),
    ("llama1b gate+up", 8192, 2048, (8192, 8192), False),
    ("qwen1.5b qkv", 8192, 1536, (1536, 256, 256), True),
    ("qwen1.5b gate+up", 8192, 1536, (8960, 8960), False),
    ("llama8b qkv", 8192, 4096, (4096, 1024, 1024), False),
    ("llama8b gate+up", 8192, 4096, (14336, 14336), False),
]


def apart(x, ws, bs):
    return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))


def merged(x, ws, bs):
    b = torch.cat(bs) if bs[0] is not None else None
    return F.linear(x, torch.cat(ws), b).split([w.shape[0] for w in ws], -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    from triton.testing import do_bench
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {'eager' if args.eager else 'torch.compile'}")
    print(f"{'shape':18s} {'apart ms':>9s} {'TF/s':>6s} {'merged ms':>10s} {'TF/s':>6s} {'speedup':>8s} {'max|dx diff|':>12s}")
    for label, m, k, ns, bias in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ws = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_() for n in ns]
        bs = [torch.zeros(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None for n in ns]
        gs = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for n in ns]
        leaves = [x, *ws, *(b for b in bs if b is not None)]
        times, dxs = [], []
        for fn in (apart, merged):
            f = fn if args.eager else torch.compile(fn)

            def step():
                torch.autograd.backward(f(x, ws, bs), gs)
                for t in leaves:
                    t.grad = None
            step()
            torch.autograd.backward(f(x, ws, bs), gs)
            dxs.append(x.grad.float())
            for t in leaves:
                t.grad = None
            times.append(do_bench(step, warmup=25, rep=200, return_mode="median"))
        flops = 6 * m * k * sum(ns)
        ta, tm = times
        print(f"{label:18s} {ta:9.3f} {flops / ta / 1e9:6.0f} {tm:10.3f} {flops / tm / 1e9:6.0f} {ta / tm:7.3f}x "
              f"{(dxs[0] - dxs[1]).abs().max().item():12.1e}", flush=True)


if __name__ == "__main__":
    main()
