"""Causal attention: PyTorch's SDPA backends side by side, bf16, on one GPU.

    python benchmarks/attention_backends.py

Shapes: gpt1.3b (micro-batch 8, 16 heads of 128, s 2048), one tp4 rank of gpt6.7b
(micro-batch 1 and 4, 8 of 32 heads), and the GQA shapes of HF Llama-3.2-1B (batch 4, 32 query
heads of 64 over 8 kv heads) and Qwen2.5-1.5B (batch 4, 12 of 128 over 2): for those, once with
the kv heads repeated to the query heads first (``repeat_kv``, what HF's sdpa path feeds SDPA),
and once with ``enable_gqa=True`` on the kv heads as they are ("+gqa"). For each backend that accepts the shape: forward and
forward+backward milliseconds (medians of triton.testing.do_bench) and TFLOP/s counting
the causal half of 4·B·H·s²·d (forward) and 3.5× that (forward + backward, as FlashAttention
reports). ``default`` is what SDPA picks with no context manager.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [("gpt1.3b", 8, 16, 16, 2048, 128), ("gpt6.7b tp4 rank, mb 1", 1, 8, 8, 2048, 128),
          ("gpt6.7b tp4 rank, mb 4", 4, 8, 8, 2048, 128),       # label, batch, heads, kv heads, s, d
          ("llama3.2-1b", 4, 32, 8, 2048, 64), ("qwen2.5-1.5b", 4, 12, 2, 2048, 128)]
BACKENDS = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cudnn {torch.backends.cudnn.version()}")
    print(f"{'shape':24s} {'backend':10s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'f+b ms':>8s} {'f+b TF/s':>9s}")
    for label, b, h, hkv, s, d in SHAPES:
        for gqa in ([False, True] if hkv < h else [False]):
            run_shape(label + ("+gqa" if gqa else ""), b, h, hkv, s, d, gqa)


def run_shape(label, b, h, hkv, s, d, gqa):
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k0, v0 = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * b * h * s * s * d / 2

    def kv():   # HF's repeat_kv, or the kv heads as they are
        if gqa or hkv == h:
            return k0, v0
        return tuple(t[:, :, None].expand(b, hkv, h // hkv, s, d).reshape(b, h, s, d) for t in (k0, v0))

    ref = None
    for name, backend in BACKENDS:
        ctx = (lambda: sdpa_kernel(backend)) if backend is not None else (lambda: torch.enable_grad())

        def fwd():
            with ctx(), torch.no_grad():
                return F.scaled_dot_product_attention(q, *kv(), is_causal=True, enable_gqa=gqa)

        def step():
            with ctx():
                F.scaled_dot_product_attention(q, *kv(), is_causal=True, enable_gqa=gqa).backward(g)
            q.grad = k0.grad = v0.grad = None
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
