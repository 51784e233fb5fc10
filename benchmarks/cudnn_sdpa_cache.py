"""Whether cuDNN's attention backward, as this torch calls it, replays a graph built for another
caller's grad-output layout (one GPU): two calls with the same q/k/v shapes and strides, the
first with a grad-output laid out unlike the attention output, the second with one laid out like
it; the second call's gradients are compared with the math backend's in fp32, and with the same
call made first in a fresh key (another sequence length).

    python benchmarks/cudnn_sdpa_cache.py

Prints one line per case: the relative error of dq, dk, dv, and whether the replay differs."""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def grads(q, k, v, do, backend):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    o.backward(do(o))
    return [t.grad for t in (q, k, v)], o


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    dev, dt = "cuda", torch.bfloat16
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    layouts = {"like_o": lambda o: torch.randn_like(o, dtype=o.dtype).mul_(1.0),        # empty_like keeps o's strides
               "bhsd": lambda o: torch.randn(o.shape, device=o.device, dtype=o.dtype)}  # contiguous (b, h, s, d)
    bad = False
    for s, (first, second) in ((1024, ("bhsd", "like_o")), (2048, ("like_o", "bhsd")), (3072, (None, "like_o")),
                               (4096, (None, "bhsd"))):
        g = torch.Generator(device=dev).manual_seed(s)
        q, k, v = (torch.randn(2, s, 8, 128, device=dev, dtype=dt, generator=g) for _ in range(3))   # (b, s, h, d)
        fixed = {}

        def layout(name):
            def make(o):
                torch.manual_seed(7)
                t = layouts[name](o)
                fixed[name] = t
                return t
            return make
        if first:
            grads(q, k, v, layout(first), SDPBackend.CUDNN_ATTENTION)
        got, o = grads(q, k, v, layout(second), SDPBackend.CUDNN_ATTENTION)
        do = fixed[second]
        ref, _ = grads(q.float(), k.float(), v.float(), lambda o_: do.float(), SDPBackend.MATH)
        err = [rel(a, b) for a, b in zip(got, ref)]
        wrong = max(err) > 0.05
        bad |= wrong and first is not None
        print(f"s={s} first dO {first or '-'} then {second} (o strides {tuple(o.stride())}, dO strides "
              f"{tuple(do.stride())}): rel err dq/dk/dv {err[0]:.3g}/{err[1]:.3g}/{err[2]:.3g}"
              + ("  WRONG" if wrong else ""))
    print("cuDNN's backward replays another layout's graph" if bad else "no replay seen")
    return 0


if __name__ == "__main__":
    sys.exit(main())
