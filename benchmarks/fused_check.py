"""Generated elementwise kernels on a GPU: forward and backward against eager PyTorch.

    python benchmarks/fused_check.py

Per chain and dtype: max error relative to max |eager| (fp32 and bf16 inputs; math in
fp32), then a tiny HF GPT-2 and Llama with parallelize(fuse=True) against the unmodified
model (loss and gradients, fp32).
"""
import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import fxmegatron  # noqa: E402
from fxmegatron.codegen.patterns import REFERENCE_CHAINS  # noqa: E402
from fxmegatron.codegen.triton_kernel import ROW, FusedChain  # noqa: E402

CHAINS = REFERENCE_CHAINS


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def main():
    dev = "cuda"
    for name, (chain, kinds, ref) in CHAINS.items():
        for dtype in (torch.float32, torch.bfloat16):
            fused = FusedChain(chain, kinds)
            a = (torch.randn(4093, 517, device=dev) * 3).to(dtype).requires_grad_()
            b = torch.randn(517 if kinds[1] == ROW else (4093, 517), device=dev).to(dtype).requires_grad_()
            y = fused.apply(a, b)
            g = torch.randn_like(y)
            y.backward(g)
            a2, b2 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
            y2 = ref(a2, b2)
            y2.backward(g.float())
            print(f"{name:16s} {str(dtype):15s} fwd {rel(y, y2):.1e}  dx0 {rel(a.grad, a2.grad):.1e}  "
                  f"dx1 {rel(b.grad, b2.grad):.1e}", flush=True)
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


if __name__ == "__main__":
    main()
