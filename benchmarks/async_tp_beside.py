"""Layouts of ``end_to_end.py`` built and stepped in one process, in a given order, one forward and
backward each, to see which model's gradients go wrong beside torch's async TP
(docs/TRAINING.md, "Beside torch's async TP"). Prints, per row, a digest of its weights at build,
its loss and first gradient norm; writes each parameter's local gradient norm per rank to
OUT.rankR.json. ``--plain``: also a one-GPU plain model's gradients, SDPA (each backend) and a
matmul on each rank before the first row and after the last, and which of them changed.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --standalone --nproc-per-node 2 benchmarks/async_tp_beside.py OUT \\
        native-tp2-async,fx-tp2-nosp:ref [--share 1d|3d] [--plain]

A row is ``LAYOUT[:MODE]``: ``ref`` builds an fx row from the plain model's weights (the native
rows always start from them), ``nostep`` builds the row without stepping it. ``--share``: every
row on one mesh (``1d``: the 1-D tp mesh, the default group; ``3d``: the (dp, pp, tp) mesh's tp
group)."""
import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import e2e  # noqa: E402,F401
from e2e.builders import BUILDERS, initial_state  # noqa: E402
from e2e.layouts import parse_layout  # noqa: E402
from e2e.master_weights import full_tensor, local_tensor  # noqa: E402
from e2e.models import build_spec  # noqa: E402
from end_to_end import parse_args as e2e_args  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, make_mesh, read_env  # noqa: E402


def probes(spec, batch, dev, dtype):
    """A plain one-GPU model's gradient norms, SDPA's output and input-gradient norms per backend, a matmul."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(4, 16, 2048, 128, device=dev, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    out = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.float().pow(2).sum().backward()
            out[f"sdpa {name}"] = [float(o.double().norm())] + [float(t.grad.double().norm()) for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
        except RuntimeError as exc:
            out[f"sdpa {name}"] = str(exc)[:80]
    a = torch.randn(8192, 4096, device=dev, dtype=dtype, generator=g)
    out["matmul"] = float((a @ torch.randn(4096, 4096, device=dev, dtype=dtype, generator=g)).double().norm())
    model = spec.plain(dev, dtype)
    spec.loss(model, batch).backward()
    out.update({f"plain {n}": float(p.grad.double().norm()) for n, p in model.named_parameters()})
    return out


def log_attention_strides():
    """Print, once per distinct layout, the strides cuDNN's attention backward is called with."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = set()

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default:
                key = tuple(tuple(a.stride()) for a in args[:5])
                if key not in seen and dist.get_rank() == 0:
                    seen.add(key)
                    print("cudnn attention backward: grad_out/q/k/v/out strides", key, "shape", tuple(args[1].shape),
                          flush=True)
            return func(*args, **(kwargs or {}))
    Log().__enter__()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("rows")
    ap.add_argument("--share", choices=["", "1d", "3d"], default="")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="turn SDPA's cuDNN backend off (torch.backends.cuda.enable_cudnn_sdp(False))")
    ap.add_argument("--log-attention", action="store_true",
                    help="print the strides of each eager cuDNN attention backward call (q, out, grad_out)")
    ap.add_argument("--model-args", default="--model gpt6.7b --layers 2 --global-batch 8",
                    help="end_to_end.py's model arguments (--tiny on CPU)")
    args = ap.parse_args()
    env = init_from_env(args.device, env=read_env(one_process_port=0))
    dev, dtype = env.device, torch.bfloat16
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.log_attention:
        log_attention_strides()
    spec = build_spec(e2e_args(args.model_args.split()))
    batch = spec.make_batch(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    @functools.lru_cache(maxsize=None)
    def mesh_of(**sizes):
        return make_mesh(env, **sizes)

    def meshes(**sizes):
        if args.share == "1d":
            return mesh_of(tp=env.world)
        if args.share == "3d":
            m = mesh_of(dp=1, pp=1, tp=env.world)
            return m if len(sizes) > 1 else m["tp"]
        return mesh_of(**sizes)

    before = probes(spec, batch, dev, dtype) if args.plain else None
    ref, rows = None, []
    for item in args.rows.split(","):
        name, _, mode = item.partition(":")
        lay = parse_layout(name, 8)
        if mode == "ref" and ref is None:
            ref = initial_state(spec, dev, dtype)
        job = BUILDERS[lay.kind](lay, spec, dev, dtype, batch, meshes=meshes, ref_state=ref if mode == "ref" else None)
        sync()
        weights = float(sum(local_tensor(p).detach().double().pow(2).sum().item() for p in job.params))
        if mode == "nostep":
            continue
        loss = job.fwd_bwd()
        sync()
        rows.append({"row": item, "weights": weights, "loss": float(local_tensor(loss).float().item()),
                     "norm": float(full_tensor(job.norm()).float().item()),
                     "grads": [None if p.grad is None else [list(local_tensor(p).shape),
                                                            float(local_tensor(p.grad).double().norm())]
                               for p in job.params]})
    after = probes(spec, batch, dev, dtype) if args.plain else None
    rank = dist.get_rank()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"rows": rows, "before": before, "after": after}, f)
    if rank == 0:
        for r in rows:
            print(f"{r['row']}: weights {r['weights']:.6g}, loss {r['loss']:.6g}, first gradient norm {r['norm']:.6g}")
        if args.plain:
            changed = [k for k in before if before[k] != after[k]]
            print("probes changed after the rows:", ", ".join(f"{k} {before[k]} -> {after[k]}" for k in changed) or "none")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
