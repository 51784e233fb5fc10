"""Parallelize the bundled GPT on CPU (tp = WORLD / pp) and compare with the unmodified model.

    torchrun --standalone --nproc_per_node 2 examples/tp_demo.py
    torchrun --standalone --nproc_per_node 4 examples/tp_demo.py --pp 2 --microbatches 4 \
        --virtual-stages 2 --schedule interleaved

Every rank builds the same model (same seed), keeps an unmodified copy as the
reference, parallelizes the other, trains both for a few AdamW steps on the
same batches and prints the two losses side by side. The transformed graphs go
to dump/rank*/ (graph.py, placements.txt, collectives.txt, plan.txt).
"""
import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig  # noqa: E402

import fxmegatron  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, make_mesh  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dump", default="dump")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (tp = world / pp)")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--schedule", default=None, choices=["gpipe", "1f1b", "interleaved"])
    args = ap.parse_args()
    env = init_from_env("cpu")      # gloo
    rank, world = env.rank, env.world
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=8, n_embd=128)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide the {world} processes")
    mesh = make_mesh(env, pp=args.pp, tp=world // args.pp)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    pm = fxmegatron.parallelize(model, mesh, batch, sequence_parallel=args.sequence_parallel,
                                recompute=args.recompute, microbatches=args.microbatches,
                                virtual_stages=args.virtual_stages, schedule=args.schedule, verbose=True)
    n_local = sum(p.numel() for p in pm.parameters())
    n_full = sum(p.numel() for p in reference.parameters())
    if rank == 0:
        print(f"bundled GPT: {args.layers} layers, h {cfg.n_embd}, {cfg.n_head} heads; pp={args.pp} "
              f"(v={args.virtual_stages}, {args.microbatches} microbatches), tp={world // args.pp}, "
              f"sequence parallel {args.sequence_parallel}, recompute {args.recompute}; "
              f"rank 0 holds {n_local:,} of {n_full:,} parameters")
        print(f"{'step':>4s}  {'fxmegatron loss':>16s}  {'unmodified loss':>16s}  {'rel. diff':>9s}")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = 0.0
    for step in range(args.steps):
        loss = pm.train_step(batch)      # forward + backward over the microbatches / pipeline schedule
        opt.step(); opt.zero_grad()
        ref = reference(*batch)
        ref.backward()
        opt_ref.step(); opt_ref.zero_grad()
        diff = abs(loss.item() - ref.item()) / abs(ref.item())
        worst = max(worst, diff)
        if rank == 0:
            print(f"{step:4d}  {loss.item():16.6f}  {ref.item():16.6f}  {diff:9.1e}")
    pm.dump(args.dump)
    if rank == 0:
        print(f"dump written to {args.dump}/rank*/ (graph.py, placements.txt, collectives.txt, plan.txt)")
        print("OK: losses match" if worst < 1e-4 else f"MISMATCH: worst relative difference {worst:.2e}")
    dist.destroy_process_group()
    sys.exit(0 if worst < 1e-4 else 1)


if __name__ == "__main__":
    main()
