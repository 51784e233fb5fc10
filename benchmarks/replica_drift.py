"""Do the tp ranks' copies of a weight replicated over tp stay the same bits through training?

    torchrun --nproc-per-node 2 benchmarks/replica_drift.py --model hf-moe64 [--steps 13] [--deterministic]

Builds ``--model`` (end_to_end.py's models and shape options) at tp = the world, with sequence
parallelism and ``compile=True`` in bf16, from the plain model's weights, and trains it on
end_to_end.py's batch (AdamW lr 1e-4, clip 1.0). After each step it all-gathers every weight
replicated over tp, and its gradient, and prints how many differ between the ranks and the
largest differences. In exact arithmetic they cannot; on a GPU a kernel that adds with atomics
rounds in its threads' order, and each rank's optimizer applies its own rounding: before
``passes/tensor_parallel/same_grads.py`` the routers of hf-moe64 parted after the first step
(docs/TENSOR_PARALLEL.md, "Replicated weights"). ``--deterministic``: torch's deterministic
algorithms (the control: nothing parts). ``--no-average``: that pass off.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fxmegatron                                           # noqa: E402
from fxmegatron.placement import R                          # noqa: E402
from e2e.builders import initial_state                      # noqa: E402
from e2e.models import build_spec                           # noqa: E402
from end_to_end import parse_args                           # noqa: E402


def _apart(named, world):
    """(name, largest difference from rank 0's) for each tensor that differs between the ranks."""
    out = []
    for name, t in named:
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t.contiguous())
        d = max(float((e.float() - every[0].float()).abs().max()) for e in every)
        if d > 0:
            out.append((name, d))
    return sorted(out, key=lambda x: -x[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--no-average", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    args, rest = ap.parse_known_args()
    if args.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.no_average:
        import fxmegatron.lower.rank_passes as rank_passes
        rank_passes.average_redundant_grads = lambda *a: []
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    spec = build_spec(parse_args(rest))
    batch = spec.make_batch(dev)
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("tp",))
    t0 = time.time()
    pm = fxmegatron.parallelize(spec.meta(torch.bfloat16), mesh, batch, sequence_parallel=True,
                                compile=not args.no_compile, state_dict=initial_state(spec, "cpu", torch.bfloat16))
    opt = pm.adamw(lr=1e-4)
    rep = [(n, p) for n, p in pm.named_parameters() if pm.placement(n) == R]
    if rank == 0:
        print(f"{spec.describe()}\ntp {world}, built in {time.time() - t0:.1f} s; {len(rep)} weights replicated "
              f"over tp{'; deterministic algorithms' if args.deterministic else ''}"
              f"{'; same_grads off' if args.no_average else ''}", flush=True)
    parted = 0
    for step in range(args.steps):
        for p in pm.parameters():
            p.grad = None
        loss = pm.train_step(batch)
        pm.clip_grad_norm_(1.0)
        grads = _apart([(n, p.grad) for n, p in rep if p.grad is not None], world)
        opt.step()
        weights = _apart(rep, world)
        parted = max(parted, len(weights))
        if rank == 0:
            print(f"step {step:2d}  loss {loss.item():.4f}  gradients apart {len(grads):2d} "
                  f"weights apart {len(weights):2d}  largest: {weights[:2]}", flush=True)
    if rank == 0:
        print(f"weights apart at most: {parted} of {len(rep)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
