"""Generated elementwise kernels on a GPU: forward and backward against eager PyTorch.

    python benchmarks/fused_check.py

Per chain and dtype: max error relative to max |eager| (fp32 and bf16 inputs; math in
fp32); the dropout masks of the kernels (``tl.rand`` compiled for the GPU) against the
same Philox in torch ops, bit for bit; then a tiny HF GPT-2 and Llama with
parallelize(fuse=True) against the unmodified model (loss and gradients, fp32), and the
bundled GPT with dropout 0.1 fused against unfused.
"""
import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import fxmegatron  # noqa: E402
from fxmegatron.codegen.patterns import REFERENCE_CHAINS  # noqa: E402
from fxmegatron.codegen.fused_chain import FusedChain  # noqa: E402
from fxmegatron.ops.dropout import DropoutRng, counter_dropout, keep_mask  # noqa: E402

CHAINS = REFERENCE_CHAINS


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def main():
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    for name, ref in CHAINS.items():
        for dtype in (torch.float32, torch.bfloat16):
            fused = FusedChain(ref.chain, ref.kinds)
            shape = ref.shape(4093, 517) if len(ref.shape(1, 1)) == 2 else ref.shape(7, 259)
            xs = [x.requires_grad_() if x.is_floating_point() else x
                  for x in ref.inputs(shape, dtype, dev, generator=gen)]
            y = fused.apply(*xs)
            g = torch.randn_like(y)
            y.backward(g)
            xs2 = [x.detach().float().requires_grad_() if x.is_floating_point() else x for x in xs]
            y2 = ref.eager(*xs2)
            y2.backward(g.float())
            errs = "  ".join(f"dx{i} {rel(a.grad, b.grad):.1e}" for i, (a, b) in enumerate(zip(xs, xs2))
                             if a.is_floating_point())
            print(f"{name:22s} {str(dtype):15s} {tuple(shape)} fwd {rel(y, y2):.1e}  {errs}", flush=True)
    # dropout on the GPU: kernel masks (tl.rand) == Philox in torch ops, bit for bit
    rng = DropoutRng(seed=5)
    rng.step = 2**31 + 3           # the step's high bit set: the key's sign bit in the kernel
    key = rng.next_key(dev)
    for shape in ((4093, 517), (8, 16, 2048, 64)):
        x = torch.ones(shape, device=dev)
        y = counter_dropout(x, 0.1, True, key, 7, shape)        # the GPU path: one generated kernel
        ref_mask = keep_mask(key.cpu(), 7, 0.1, shape, shape)
        same = torch.equal((y != 0).cpu(), ref_mask)
        print(f"dropout {shape}: kernel mask == torch Philox mask: {same}; keep rate "
              f"{(y != 0).float().mean().item():.5f}", flush=True)
    from tests import models
    for name in ("gpt2", "llama"):
        model = models.build(name, n_layer=2).cuda()
        b = {k: v.cuda() for k, v in models.batch(name).items()}
        ref = copy.deepcopy(model)
        lr_ = models.call(ref, b)
        lr_.backward()
        torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29577", rank=0, world_size=1) \
            if not torch.distributed.is_initialized() else None
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
        pm = fxmegatron.parallelize(model, mesh, b, fuse=True)
        n_fused = sum(1 for k, _ in pm.graph_module.named_children() if k.startswith("fused_"))
        loss = pm(b)
        loss.backward()
        grads = pm.full_grads()
        worst = max(rel(grads[n], p.grad) for n, p in ref.named_parameters() if p.grad.abs().max() > 1e-3)
        print(f"{name}: {n_fused} fused groups, loss {loss.item():.6f} vs {lr_.item():.6f}, worst grad err "
              f"{worst:.1e}", flush=True)
    model = models.build("gpt", dropout=0.1, n_layer=2).cuda()
    b = tuple(t.cuda() for t in models.batch("gpt"))
    out = []
    for fuse in (False, True):
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, b, fuse=fuse, seed=3)
        loss = pm(b)
        loss.backward()
        out.append((loss.item(), pm.full_grads()))
    worst = max(rel(out[1][1][n], g) for n, g in out[0][1].items())
    print(f"gpt dropout 0.1: fused loss {out[1][0]:.7f} vs unfused {out[0][0]:.7f}, worst grad err {worst:.1e}",
          flush=True)


if __name__ == "__main__":
    main()
