"""The mixed-precision optimizer step of gpt1.3b on one GPU: the end-to-end benchmark's path
against ``fxmegatron.optim.FusedAdamW``.

    python benchmarks/optimizer_step.py [--warmup 5] [--iters 20]

Parameters: gpt1.3b's (24 layers, h 2048, V 50304, 2048 positions, untied lm_head), bf16,
with random bf16 gradients. Each timed step is gradient clipping to norm 1.0 and AdamW
(lr 1e-4, weight decay 1e-2) on fp32 master weights:

* ``unfused``: ``benchmarks/end_to_end.py``'s path: the norm (``torch._foreach_norm``),
  ``torch._foreach_mul_`` of the coefficient into the bf16 gradients, then
  ``MasterWeightAdamW.step`` (copy into fp32 gradient buffers, ``torch.optim.AdamW(fused=True)``
  on the masters, copy the masters back into the parameters);
* ``fused``: the same norm, then ``FusedAdamW.step(grad_scale=coef)``: one kernel;
* ``fused step only``: ``FusedAdamW.step`` without the norm (grad_scale 1).

Both optimizers set the gradients to None; before each step (not timed) every parameter gets
its gradient back from a list kept here. Times: median of --iters steps after --warmup, CUDA
events around each step. GB/s counts the bytes a fused step must move, 30 per parameter:
2 (gradient read by the norm) + 2 (gradient) + 12 (master, m, v read) + 12 (written) + 2
(bf16 parameter written); 28 for the step alone. A device-to-device copy gives the scale.

First, a check on small shapes (chunk boundaries, a parameter without a gradient, a grad
scale below 1): FusedAdamW against MasterWeightAdamW after three steps; it exits non-zero
if they disagree.
"""
import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

L, H, V, S = 24, 2048, 50304, 2048


def gpt13b_shapes():
    shapes = [(V, H), (S, H)]                                   # wte, wpe
    for _ in range(L):
        shapes += [(H,), (H,),                                  # ln1 weight, bias
                   (3 * H, H), (3 * H,),                        # qkv
                   (H, H), (H,),                                # attention proj
                   (H,), (H,),                                  # ln2
                   (4 * H, H), (4 * H,),                        # fc
                   (H, 4 * H), (H,)]                            # fc2
    shapes += [(H,), (H,), (V, H)]                              # final ln, lm_head
    return shapes


def clip_coef(grads, max_norm=1.0):
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6)), on device."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def time_steps(params, grads, step, warmup, iters):
    times = []
    for k in range(warmup + iters):
        for p, g in zip(params, grads):
            p.grad = g
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        if k >= warmup:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(args):
    big = torch.empty(2**28, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(big)
    t = time_steps([], [], lambda: out.copy_(big), args.warmup, args.iters)
    return 2 * big.numel() * 2 / (t * 1e-3) / 1e9


def time_unfused(MasterWeightAdamW, params, grads, args):
    """ms per step of end_to_end.py's path (its optimizer state is freed on return)."""
    opt = MasterWeightAdamW(params, lr=1e-4, fused=True)

    def step():
        g = [p.grad for p in params]
        torch._foreach_mul_(g, clip_coef(g))
        opt.step()

    return time_steps(params, grads, step, args.warmup, args.iters)


def check(MasterWeightAdamW, FusedAdamW):
    """FusedAdamW against MasterWeightAdamW on small bf16 shapes; True if they agree. The reference
    runs torch's foreach AdamW, not the fused CUDA one: that one rounds its bias corrections in
    fp32 (1 - 0.999 becomes 0.00099998713, 1.3e-5 off: measured), where torch's other paths and
    FusedAdamW compute them in double on the host."""
    torch.manual_seed(0)
    shapes = [(37,), (300, 7), (1,), (8192 + 5,), (3, 8192)]
    params_a = [torch.nn.Parameter(torch.randn(s, device="cuda").bfloat16()) for s in shapes]
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    ref = MasterWeightAdamW(params_a, lr=1e-2, fused=False)
    for g in ref.opt.param_groups:
        g["weight_decay"] = 0.1
    opt = FusedAdamW(params_b, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        grads = [torch.randn(s, device="cuda").bfloat16() for s in shapes]
        if step == 1:
            grads[2] = None
        coef = torch.tensor(0.5 if step < 2 else 1.0, device="cuda")
        for pa, pb, g in zip(params_a, params_b, grads):
            pa.grad = None if g is None else g * coef       # MasterWeightAdamW takes clipped gradients
            pb.grad = g
        ref.step()
        opt.step(grad_scale=coef)
    worst, ok = 0.0, True
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        st = ref.opt.state[ref.masters[i]]
        for name, x, y in (("master", opt.masters[i], ref.masters[i]), ("exp_avg", opt.exp_avgs[i], st["exp_avg"]),
                           ("exp_avg_sq", opt.exp_avg_sqs[i], st["exp_avg_sq"])):
            err = ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
            worst = max(worst, err)
            ok &= err <= 1e-5
        # bf16 parameters: at most one bf16 ulp apart (the masters may round differently at a tie)
        ok &= torch.allclose(pa.float(), pb.float(), rtol=2**-7, atol=0)
        ok &= opt.steps[i] == int(st["step"])
    print(f"check on small shapes: {'ok' if ok else 'FAILED'} (largest relative difference of masters and "
          f"moments {worst:.1e})", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("optimizer_step.py needs CUDA: no GPU here, nothing timed.")
        return 0

    from e2e.master_weights import MasterWeightAdamW

    from fxmegatron.optim import FusedAdamW

    if not check(MasterWeightAdamW, FusedAdamW):
        return 1

    shapes = gpt13b_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"gpt1.3b: {len(shapes)} parameters, {n / 1e9:.3f} B elements, bf16 (device: "
          f"{torch.cuda.get_device_name()})", flush=True)
    print(f"device-to-device copy: {copy_bandwidth(args):.0f} GB/s (read + write)")

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.empty(s, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02))
              for s in shapes]
    grads = [torch.randn_like(p) for p in params]
    rows = [("unfused (end_to_end.py)", time_unfused(MasterWeightAdamW, params, grads, args), 30)]
    torch.cuda.empty_cache()
    # the unfused clip scaled the kept gradients in place: fresh ones for the fused runs
    grads = [torch.randn_like(p) for p in params]

    opt_b = FusedAdamW(params, lr=1e-4, weight_decay=1e-2)

    def fused():
        opt_b.step(grad_scale=clip_coef([p.grad for p in params]))

    rows.append(("fused (norm + FusedAdamW)", time_steps(params, grads, fused, args.warmup, args.iters), 30))
    rows.append(("fused step only", time_steps(params, grads, opt_b.step, args.warmup, args.iters), 28))

    print(f"\n{'path':28s} {'ms/step':>8s} {'GB/s':>6s}  (bytes counted: per parameter)")
    for name, ms, per in rows:
        print(f"{name:28s} {ms:8.2f} {per * n / (ms * 1e-3) / 1e9:6.0f}  ({per} B)")
    print(f"\nfused vs unfused: {rows[0][1] / rows[1][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
