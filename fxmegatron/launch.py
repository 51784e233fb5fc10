"""Train from a folder written by ``fxmegatron compile`` (no model code needed).

    torchrun --nproc_per_node N -m fxmegatron.launch FOLDER [--dp D] --data text.txt --steps 100

N = dp * pp * tp, with pp and tp as compiled. Batches are causal-LM batches
``(tokens, labels)`` of byte-level tokens (``--data FILE``) or of uniformly random
tokens (``--data random``), shaped like the compiled example batch: rows =
microbatch rows * microbatches * dp. Each step prints the loss on rank 0;
``--losses FILE`` writes them as JSON.

FOLDER is code: its stage.py files run in every process. Before anything else (the process
group included), every file is checked against the SHA-256 the manifest records, and a
folder changed since it was written is refused (``check_folder``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree


def lm_batch(data, step: int, rows: int, seq: int, seed: int = 0, vocab: int = 256):
    """(tokens, labels) for ``step``: windows of ``data`` (a uint8 tensor) or random tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if data is None:
        window = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    else:
        starts = torch.randint(0, len(data) - seq - 1, (rows,), generator=g)
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fxmegatron.launch", description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (pp*tp))")
    ap.add_argument("--data", default="random", help="a text file (byte-level tokens) or 'random'")
    ap.add_argument("--vocab", type=int, default=256, help="token range for --data random")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--losses", default="", help="write the per-step losses (JSON) here")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: cuda (nccl) when there is one GPU per local process, else cpu (gloo)")
    args = ap.parse_args(argv)

    from fxmegatron.io.stage_folder import check_folder, load_folder
    from fxmegatron.runtime.distributed import init_from_env, make_mesh

    # before the process group: a refused folder then fails on every rank alone, at once
    checked = check_folder(args.folder)
    man = checked.manifest
    env = init_from_env(args.device)
    world = env.world
    pp, tp = man["layout"]["pp"], man["layout"]["tp"]
    dp = args.dp or world // (pp * tp)
    if dp * pp * tp != world:
        raise SystemExit(f"dp={dp} x pp={pp} x tp={tp} (compiled) != {world} processes")
    mesh = make_mesh(env, dp=dp, pp=pp, tp=tp)
    pm = load_folder(checked, mesh)
    spec = pytree.treespec_loads(man["in_spec"])
    rows, seq = man["batch"][0]["shape"][0] * man["microbatches"] * dp, man["batch"][0]["shape"][1]
    data = None
    if args.data != "random":
        with open(args.data, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    rank0 = env.lead
    if rank0:
        print(f"fxmegatron.launch: {args.folder} at dp={dp} pp={pp} tp={tp}, {man['schedule']} "
              f"m={man['microbatches']} v={man['virtual_stages']}, batch {rows}x{seq}", flush=True)
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        tokens, labels = lm_batch(data, step, rows, seq, args.seed, args.vocab)
        batch = pytree.tree_unflatten([tokens, labels], spec)
        args_, kwargs = batch
        loss = pm.train_step(*args_, **kwargs)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank0:
            print(f"step {step:4d}  loss {losses[-1]:.6f}  ({time.time() - t0:.1f} s)", flush=True)
    if rank0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from fxmegatron.errors import CompiledFolderError
    try:
        sys.exit(main())
    except CompiledFolderError as exc:     # the message says it all; a traceback would bury it
        sys.exit(f"fxmegatron.launch: CompiledFolderError: {exc}")
