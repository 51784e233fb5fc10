"""Causal attention: PyTorch's SDPA backends side by side, bf16, on one GPU.

    python benchmarks/attention_backends.py

Shapes: gpt1.3b (micro-batch 8, 16 heads of 128, s 2048) and one tp4 rank of gpt6.7b
(micro-batch 1 and 4, 8 of 32 heads). For each backend that accepts the shape: forward and
forward+backward milliseconds (medians of triton.testing.do_bench) and TFLOP/s counting
the causal half of 4·B·H·s²·d (forward) and 3.5× that (forward + backward, as FlashAttention
reports). ``default`` is what SDPA picks with no context manager.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [("gpt1.3b", 8, 16, 2048, 128), ("gpt6.7b tp4 rank, mb 1", 1, 8, 2048, 128),
          ("gpt6.7b tp4 rank, mb 4", 4, 8, 2048, 128)]
BACKENDS = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cudnn {torch.backends.cudnn.version()}")
    print(f"{'shape':24s} {'backend':10s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'f+b ms':>8s} {'f+b TF/s':>9s}")
    for label, b, h, s, d in SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        flops = 4 * b * h * s * s * d / 2
        ref = None
        for name, backend in BACKENDS:
            ctx = (lambda: sdpa_kernel(backend)) if backend is not None else (lambda: torch.enable_grad())

            def fwd():
                with ctx(), torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def step():
                with ctx():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
                q.grad = k.grad = v.grad = None
            try:
                y = fwd()
                ref = y if ref is None else ref
                err = (y.float() - ref.float()).abs().max().item()
                tf, tb = bench(fwd), bench(step)
            except RuntimeError as e:
                print(f"{label:24s} {name:10s} unavailable: {str(e).splitlines()[0][:80]}")
                continue
            print(f"{label:24s} {name:10s} {tf:8.3f} {flops / tf / 1e9:9.1f} {tb:8.3f} "
                  f"{3.5 * flops / tb / 1e9:9.1f}   max|y - default| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
