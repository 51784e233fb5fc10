"""Pipeline (and pp x tp) parity on GPUs with NCCL: fxmegatron vs the unmodified model.

    torchrun --standalone --nproc_per_node 2 benchmarks/nccl_pipeline_check.py
    torchrun --standalone --nproc_per_node 4 benchmarks/nccl_pipeline_check.py --tp 2

For each schedule: two AdamW steps, losses next to the unmodified model's (fp32).
"""
import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]
from gpt import GPT, GPTConfig  # noqa: E402

import fxmegatron  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, make_mesh  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    env = init_from_env("cuda")
    pp = env.world // args.tp
    mesh = make_mesh(env, pp=pp, tp=args.tp)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, block_size=128, n_layer=8, n_head=8, n_embd=256)
    base = GPT(cfg).cuda()
    g = torch.Generator().manual_seed(1)
    batches = [tuple(t.cuda() for t in (torch.randint(0, 512, (8, 128), generator=g),) * 2) for _ in range(2)]
    for sched, v, m in [("1f1b", 1, 4), ("gpipe", 1, 4), ("interleaved", 2, 4), ("gpipe", 2, 4)]:
        ref = copy.deepcopy(base)
        pm = fxmegatron.parallelize(copy.deepcopy(base), mesh, batches[0], microbatches=m, virtual_stages=v,
                                    schedule=sched)
        o1, o2 = torch.optim.AdamW(ref.parameters(), lr=1e-3), torch.optim.AdamW(pm.parameters(), lr=1e-3)
        t0 = time.time()
        rows = []
        for i, b in enumerate(batches):
            lr_ = ref(*b)
            lr_.backward()
            loss = pm.train_step(b)
            rows.append((loss.item(), lr_.item()))
            if i == 0:   # gradient errors of this rank's parameters, worst first
                full = pm.full_grads()
                refg = dict(ref.named_parameters())
                errs = sorted(((((full[n] - refg[n].grad).abs().max() /
                                 refg[n].grad.abs().max().clamp_min(1e-12)).item(), n) for n in full), reverse=True)
                print(f"  rank {dist.get_rank()} {sched} v={v}: {len(full)} grads, worst "
                      f"{[(n, f'{e:.1e}') for e, n in errs[:3]]}", flush=True)
            o1.step(); o1.zero_grad(); o2.step(); o2.zero_grad()
        torch.cuda.synchronize()
        if dist.get_rank() == 0:
            err = max(abs(a - b) / abs(b) for a, b in rows)
            print(f"pp={pp} tp={args.tp} {sched:12s} v={v} m={m}: losses {[round(a, 6) for a, _ in rows]} "
                  f"ref {[round(b, 6) for _, b in rows]} max rel err {err:.1e} ({time.time() - t0:.2f} s)",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
