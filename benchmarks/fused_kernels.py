"""Generated elementwise kernels against eager PyTorch and torch.compile, bf16, on one GPU.

    python benchmarks/fused_kernels.py

Shapes: gpt1.3b's MLP (tokens 8·2048, 4h = 8192: bias + GeLU, tanh and erf) and
Llama-3-8B's MLP (tokens 8·2048, 14336: SiLU·mul). Times are medians of
triton.testing.do_bench. Bandwidth counts the fewest bytes each pass must move
(inputs read once, outputs written once) against a measured device-to-device copy.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from fxmegatron.codegen.patterns import REFERENCE_CHAINS  # noqa: E402
from fxmegatron.codegen.triton_kernel import ROW, FusedChain  # noqa: E402

TOKENS = 8 * 2048
# (label, reference chain, width)
CASES = [("gpt1.3b bias+GeLU(tanh)", "bias_gelu_tanh", 8192), ("gpt1.3b bias+GeLU(erf)", "bias_gelu_erf", 8192),
         ("llama8b SiLU*mul", "swiglu", 14336)]


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    dev = "cuda"
    big = torch.empty(2**28, dtype=torch.bfloat16, device=dev).normal_()
    out = torch.empty_like(big)
    t = bench(lambda: out.copy_(big))
    copy_bw = 2 * big.numel() * 2 / (t * 1e-3) / 1e9
    del big, out
    print(f"device-to-device copy: {copy_bw:.0f} GB/s (read + write)\n", flush=True)
    print(f"{'chain':26s} {'pass':8s} {'eager ms':>9s} {'compile ms':>10s} {'fused ms':>9s} "
          f"{'fused GB/s':>10s} {'% copy':>7s}")
    for name, key, n in CASES:
        chain, kinds, ref = REFERENCE_CHAINS[key]
        fused = FusedChain(chain, kinds)
        a = torch.randn(TOKENS, n, device=dev, dtype=torch.bfloat16).requires_grad_()
        b = torch.randn(n if kinds[1] == ROW else (TOKENS, n), device=dev, dtype=torch.bfloat16).requires_grad_()
        g = torch.randn(TOKENS, n, device=dev, dtype=torch.bfloat16)
        compiled = torch.compile(ref)
        full_b = 2 * a.numel()
        b_bytes = 2 * b.numel()
        fwd_bytes = full_b + b_bytes + full_b                  # read a, b; write y
        bwd_bytes = full_b + b_bytes + full_b + full_b + (b_bytes if kinds[1] == ROW else full_b)
        with torch.no_grad():
            te = bench(lambda: ref(a, b))
            tc = bench(lambda: compiled(a, b))
            tf = bench(lambda: fused.forward(a, b))
        print(f"{name:26s} {'forward':8s} {te:9.3f} {tc:10.3f} {tf:9.3f} {fwd_bytes / tf / 1e6:10.0f} "
              f"{fwd_bytes / tf / 1e6 / copy_bw * 100:6.0f}%", flush=True)

        def step(f):
            def run():
                y = f(a, b)
                y.backward(g)
                a.grad = b.grad = None
            return run
        te = bench(step(ref))
        tc = bench(step(compiled))
        tf = bench(step(fused.apply))
        both = fwd_bytes + bwd_bytes
        print(f"{name:26s} {'fwd+bwd':8s} {te:9.3f} {tc:10.3f} {tf:9.3f} {both / tf / 1e6:10.0f} "
              f"{both / tf / 1e6 / copy_bw * 100:6.0f}%", flush=True)


if __name__ == "__main__":
    main()
