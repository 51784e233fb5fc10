"""Each GEMM of a transformer step: torch's matmul against every algorithm cuBLASLt's heuristic
offers for it, bf16, one GPU.

    PYTHONPATH=. python benchmarks/gemm_algorithms.py [--tokens 16384 --hidden 2048 --ffn 8192 --vocab 50304]

For each linear of a GPT block (qkv, proj, fc1, fc2) and the LM head, its three GEMMs (forward
y = x·Wᵀ, input gradient dx = dy·W, weight gradient dW = dyᵀ·x) in the layouts a training
step uses. A row: torch's time (the cuBLAS call torch and inductor make), the time of the
heuristic's first algorithm through ``kernels/cublaslt.py``, the best of the candidates it
offers (at most 8 were offered on an H100) and that one's index. Times are
``triton.testing.do_bench``'s median, the L2 flushed between runs. What the table was for:
whether choosing algorithms by timing (as ``kernels/cublaslt.py`` does for the GeLU epilogue)
would pay for plain GEMMs too. Alone it would (docs/history/PERFORMANCE-2026-11-26.md); inside a step it did not.
"""
import argparse

import torch


def shapes(t, h, f, v):
    for name, n_in, n_out in (("qkv", h, 3 * h), ("proj", h, h), ("fc1", h, f), ("fc2", f, h), ("head", h, v)):
        x = torch.randn(t, n_in, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(t, n_out, device="cuda", dtype=torch.bfloat16)
        yield f"{name} fwd", x, w.t()
        yield f"{name} dx", dy, w
        yield f"{name} dW", dy.t(), x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--candidates", type=int, default=32)
    args = ap.parse_args()
    from triton.testing import do_bench

    from fxmegatron.kernels import cublaslt
    cublaslt.CANDIDATES = args.candidates
    times = {}

    def record(launch, algos):      # stands in for the module's choice: time every candidate
        got = []
        for algo in algos:
            try:
                got.append(do_bench(lambda: launch(algo), warmup=10, rep=40, return_mode="median"))
            except cublaslt.CublasLtError:
                got.append(float("inf"))
        times["last"] = got
        return min(range(len(algos)), key=got.__getitem__)
    setattr(cublaslt, "_fastest", record)
    print(f"{'gemm':10s} {'m x n x k':>22s} {'torch ms':>9s} {'first ms':>9s} {'best ms':>8s} {'best #':>6s} "
          f"{'of':>3s} {'torch/best':>10s}")
    tot_torch = tot_best = 0.0
    for name, a, b in shapes(args.tokens, args.hidden, args.ffn, args.vocab):
        torch_ms = do_bench(lambda: a @ b, warmup=10, rep=40, return_mode="median")
        out = cublaslt.mm(a, b)
        torch.testing.assert_close(out, a @ b, rtol=2e-2, atol=2e-1)
        got = times["last"]
        best = min(range(len(got)), key=got.__getitem__)
        tot_torch += torch_ms
        tot_best += min(torch_ms, got[best])
        shape = f"{a.shape[0]} x {b.shape[1]} x {a.shape[1]}"
        print(f"{name:10s} {shape:>22s} {torch_ms:9.3f} {got[0]:9.3f} {got[best]:8.3f} {best:6d} {len(got):3d} "
              f"{torch_ms / got[best]:10.3f}")
    print(f"sum: torch {tot_torch:.3f} ms, the faster of torch and the best {tot_best:.3f} ms "
          f"({tot_torch / tot_best:.3f}x)")


if __name__ == "__main__":
    main()
