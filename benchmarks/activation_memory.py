"""Bytes saved for backward per transformer layer, measured on CPU, next to the formulas
of Korthikanti et al. 2022 (Table 2; 16-bit activations, dropout masks 1 byte).

    python benchmarks/activation_memory.py            # s=512, h=256, 8 heads, b=2, tp=2

Per-layer bytes = (model with 2 layers) - (model with 1 layer), per rank, bf16, dropout 0.1,
counted with torch.autograd.graph.saved_tensors_hooks (parameters excluded).
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

# "no parallelism": the unmodified model; "fxmegatron tp=1": the same model through fxmegatron on
# one process (its dropout runs unfused attention with a 1-byte mask: see fxmegatron/rng.py)
LAYOUTS = [("no parallelism", None), ("fxmegatron tp=1", "single"), ("TP", dict(sequence_parallel=False)),
           ("TP+SP", dict(sequence_parallel=True)),
           ("TP+SP+selective", dict(sequence_parallel=True, recompute="selective")),
           ("TP+SP+full", dict(sequence_parallel=True, recompute="full"))]


def _model(layers, s, h, heads):
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=s, n_layer=layers, n_head=heads, n_embd=h,
                         dropout=0.1)).to(torch.bfloat16).train()


def _bytes(layers, s, h, heads, b, kwargs, mesh):
    import fxmegatron
    from fxmegatron.runtime.memory import saved_bytes
    model = _model(layers, s, h, heads)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 256, (b, s), generator=g), torch.randint(0, 256, (b, s), generator=g))
    if kwargs == "single":
        runner = fxmegatron.parallelize(model, None, batch)
    else:
        runner = model if kwargs is None else fxmegatron.parallelize(model, mesh, batch, **kwargs)
    with saved_bytes(exclude=list(runner.parameters())) as m:
        loss = runner(*batch) if kwargs is None else runner(batch)
    loss.backward()
    return m["bytes"]


def measure(rank, world, s, h, heads, b):
    """{layout: per-layer bytes on this rank}."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {name: _bytes(2, s, h, heads, b, kw, mesh) - _bytes(1, s, h, heads, b, kw, mesh)
            for name, kw in LAYOUTS}


def formulas(s, h, a, b, t):
    return {"no parallelism": s * b * h * (34 + 5 * a * s / h),
            "fxmegatron tp=1": s * b * h * (34 + 5 * a * s / h),
            "TP": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
            "TP+SP": s * b * h / t * (34 + 5 * a * s / h),
            "TP+SP+selective": 34 * s * b * h / t,
            "TP+SP+full": 2 * s * b * h}


def _worker(rank, world, args, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    res = measure(rank, world, *args)
    if rank == 0:
        torch.save(res, f"{tmp}/res.pt")
    dist.barrier()
    # no destroy_process_group: a gloo rank tearing down after its peer has exited can abort
    # (SIGABRT, seen once in CI); as tests/distributed.py, the process just ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(s=512, h=256, heads=8, b=2, tp=2):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(tp, (s, h, heads, b), tmp), nprocs=tp, join=True, start_method="spawn")
        return torch.load(f"{tmp}/res.pt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    a = ap.parse_args()
    res = run(a.seq, a.hidden, a.heads, a.batch, a.tp)
    ref = formulas(a.seq, a.hidden, a.heads, a.batch, a.tp)
    sbh = a.seq * a.batch * a.hidden
    print(f"s={a.seq} h={a.hidden} a={a.heads} b={a.batch} t={a.tp}; bytes saved for backward per layer, per rank (bf16)")
    print(f"{'layout':18s} {'measured':>12s} {'/sbh':>7s} {'paper':>12s} {'/sbh':>7s}")
    for name, _ in LAYOUTS:
        print(f"{name:18s} {res[name]:12,d} {res[name] / sbh:7.2f} {int(ref[name]):12,d} {ref[name] / sbh:7.2f}")


if __name__ == "__main__":
    main()
