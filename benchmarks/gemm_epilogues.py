"""An MLP's linear → tanh GeLU → linear, its GeLU in a cuBLASLt epilogue (``ops.gemm_epilogue``)
or as ATen/inductor kernels, bf16, one GPU, forward + backward.

    python benchmarks/gemm_epilogues.py [--tokens 16384 --hidden 2048 --ffn 8192]

Rows: the plain ops eager and under torch.compile (the GeLU as ATen's, and in the sigmoid form
that ``passes/gelu_for_inductor.py`` gives inductor), and ``linear_gelu`` eager and compiled. Each time is the median of triton.testing.do_bench
over forward + backward; "saved" is the memory the forward leaves for backward (outputs
excluded); TFLOP/s counts 6·2·T·h·f (three GEMMs of each linear).
"""
import argparse

import torch
import torch.nn.functional as F


def plain(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def plain_sigmoid(x, w1, b1, w2, b2):
    from fxmegatron.ops.gemm_epilogue import CUBIC, TWO_SQRT_2_OVER_PI
    pre = F.linear(x, w1, b1).float()
    act = (pre * torch.sigmoid(pre * (TWO_SQRT_2_OVER_PI + CUBIC * pre * pre))).to(x.dtype)
    return F.linear(act, w2, b2)


def epilogues(x, w1, b1, w2, b2):
    from fxmegatron.ops.gemm_epilogue import linear_gelu
    return F.linear(linear_gelu(x, w1, b1), w2, b2)


def _kernels(step):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
        if e.device_time_total > 0:
            print(f"    {e.device_time_total / 5 / 1e3:7.3f} ms  {e.count // 5:3d}x  {e.key[:90]}")


TILES = [(256, 32, 128, 4), (128, 16, 256, 4), (256, 16, 256, 8), (512, 32, 256, 8), (64, 64, 128, 4),
         (128, 32, 256, 8), (256, 64, 128, 8), (1024, 32, 128, 4), (512, 8, 512, 4), (256, 8, 1024, 8),
         (128, 4, 1024, 4), (64, 8, 512, 4)]


def _tiles(t, f):
    from triton.testing import do_bench

    from fxmegatron.kernels.gelu_backward import gelu_tanh_backward_bias
    from fxmegatron.ops.gemm_epilogue import CUBIC, TWO_SQRT_2_OVER_PI, gelu_tanh_backward
    pre = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
    dact = torch.randn(t, f, device="cuda", dtype=torch.bfloat16)
    gb = 3 * t * f * 2 / 1e9

    def inductor(d, x):
        dp = gelu_tanh_backward(d, x)
        return dp, dp.sum(0)
    fn = torch.compile(inductor)
    ref = fn(dact, pre)
    ms = do_bench(lambda: fn(dact, pre), warmup=20, rep=200)
    print(f"inductor (sigmoid form + sum): {ms:.4f} ms, {gb / ms:.2f} TB/s of dact, pre and dpre")
    for tiles in TILES:
        got = gelu_tanh_backward_bias(dact, pre, TWO_SQRT_2_OVER_PI, CUBIC, tiles)
        err = max((got[0].float() - ref[0].float()).abs().max().item(), (got[1].float() - ref[1].float()).abs().max().item())
        ms = do_bench(lambda: gelu_tanh_backward_bias(dact, pre, TWO_SQRT_2_OVER_PI, CUBIC, tiles), warmup=20, rep=200)
        print(f"rows {tiles[0]:5d} bt {tiles[1]:3d} bn {tiles[2]:5d} warps {tiles[3]}: {ms:.4f} ms, {gb / ms:.2f} TB/s, max|diff| {err:.2e}")


def _dgelu(t, h, f, kernels):
    """The second linear's input gradient and the GeLU's backward: the GEMM then
    ``kernels.gelu_backward`` (what ``ops.gemm_epilogue`` runs), against cuBLASLt's ``DGELU``
    epilogue (the derivative in the GEMM) then a column sum for the bias gradient, and
    ``DGELU_BGRAD``. The error is against dact·gelu'(pre) in fp32 from the bf16 operands."""
    from triton.testing import do_bench

    from fxmegatron.kernels import cublaslt
    from fxmegatron.ops.gemm_epilogue import CUBIC, TWO_SQRT_2_OVER_PI, gelu_backward_bias, gelu_tanh_backward
    dev, dt = "cuda", torch.bfloat16
    dy = torch.randn(t, h, device=dev, dtype=dt)
    w2 = torch.randn(h, f, device=dev, dtype=dt) * h ** -0.5
    pre = torch.randn(t, f, device=dev, dtype=dt) * 2
    exact = gelu_tanh_backward((dy.float() @ w2.float()), pre.float())
    db_exact = exact.sum(0)

    def separate():
        return gelu_backward_bias(dy @ w2, pre)

    def dgelu():
        d = cublaslt.mm(dy, w2, "dgelu", aux=pre)
        return d, d.sum(0, dtype=torch.float32).to(d.dtype)

    def dgelu_bgrad():
        db = torch.empty(f, device=dev, dtype=dt)
        return cublaslt.mm(dy, w2, "dgelu_bgrad", bias=db, aux=pre), db
    print(f"dact = dy·w2 [{t}, {f}] then gelu' and the bias gradient, bf16")
    for name, fn in (("GEMM + gelu_backward_bias", separate), ("DGELU + sum", dgelu), ("DGELU_BGRAD", dgelu_bgrad)):
        d, db = fn()
        if d is None:
            print(f"{name:28s} cuBLASLt has no algorithm")
            continue
        ms = do_bench(fn, warmup=20, rep=300)
        err = (d.float() - exact).abs().max().item() / exact.abs().max().item()
        derr = (db.float() - db_exact).abs().max().item() / db_exact.abs().max().item()
        print(f"{name:28s} {ms:8.4f} ms   max|dpre err|/max {err:.2e}   max|db err|/max {derr:.2e}")
        if kernels:
            _kernels(fn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--kernels", action="store_true", help="each row's kernels (torch.profiler, 5 steps)")
    ap.add_argument("--tiles", action="store_true",
                    help="only time kernels.gelu_backward's tile sizes against inductor's GeLU backward + sum")
    ap.add_argument("--dgelu", action="store_true",
                    help="only time the GeLU's backward: after the GEMM, or in cuBLASLt's DGELU epilogue")
    args = ap.parse_args()
    from triton.testing import do_bench

    t, h, f = args.tokens, args.hidden, args.ffn
    if args.tiles:
        return _tiles(t, f)
    if args.dgelu:
        return _dgelu(t, h, f, args.kernels)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, tokens {t}, hidden {h}, ffn {f}, bf16")
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(t, h, device=dev, dtype=dt, requires_grad=True)
    w1 = (torch.randn(f, h, device=dev, dtype=dt) * h ** -0.5).requires_grad_()
    b1 = (torch.randn(f, device=dev, dtype=dt) * 0.1).requires_grad_()
    w2 = (torch.randn(h, f, device=dev, dtype=dt) * f ** -0.5).requires_grad_()
    b2 = (torch.randn(h, device=dev, dtype=dt) * 0.1).requires_grad_()
    dy = torch.randn(t, h, device=dev, dtype=dt)
    leaves = [x, w1, b1, w2, b2]
    rows = [("plain eager", plain), ("plain compiled", torch.compile(plain)),
            ("sigmoid compiled", torch.compile(plain_sigmoid)),
            ("epilogue eager", epilogues), ("epilogue compiled", torch.compile(epilogues))]
    flops = 6 * 2 * t * h * f
    ref = None
    print(f"{'row':20s} {'ms':>8s} {'TFLOP/s':>8s} {'saved MiB':>10s} {'max|dx - plain|':>16s}")
    for name, fn in rows:
        def step():
            fn(*leaves).backward(dy)
            for p in leaves:
                p.grad = None
        step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = fn(*leaves)
        saved = (torch.cuda.memory_allocated() - before - y.numel() * y.element_size()) / 2 ** 20
        y.backward(dy)
        dx = x.grad.clone()
        for p in leaves:
            p.grad = None
        ref = dx if ref is None else ref
        ms = do_bench(step, warmup=10, rep=200)
        if args.kernels:
            _kernels(step)
        print(f"{name:20s} {ms:8.3f} {flops / ms / 1e9:8.1f} {saved:10.1f} {(dx.float() - ref.float()).abs().max().item():16.3e}")
    from fxmegatron.kernels import cublaslt
    for epilogue, m, n, k, i, count in cublaslt.chosen_algorithms():
        print(f"cuBLASLt {epilogue} m={m} n={n} k={k}: kept candidate {i} of {count}")


if __name__ == "__main__":
    main()
