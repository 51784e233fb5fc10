"""A toy training loop under the Watchdog, for tests/test_train_watchdog.py.

Run by torchrun, or as plain processes given RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(no launcher that could end the job for us: peers on other hosts). Each step all-reduces
one number. ``--fault`` on rank ``--fault-rank`` at step ``--at``, after ``wd.step``:
raise (a ValueError escapes the loop), kill (SIGKILL itself), stall (sleep forever).
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fxmegatron.train.watchdog import Watchdog  # noqa: E402  (after the repo root is on the path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=["none", "raise", "kill", "stall"], default="none")
    ap.add_argument("--fault-rank", type=int, default=0)
    ap.add_argument("--at", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-s", type=float, default=0.05, help="seconds of 'work' in each step")
    ap.add_argument("--slow-first", type=float, default=0.0, help="extra seconds in step 0 (compiling)")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--first-timeout", type=float, default=20.0)
    ap.add_argument("--peer-timeout", type=float, default=None)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--other-hosts", action="store_true",
                    help="judge peers by heartbeats alone, as if each rank ran on a host of its own")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with Watchdog(rank, world, timeout_s=args.timeout, poll_s=args.poll, first_step_timeout_s=args.first_timeout,
                  peer_timeout_s=args.peer_timeout, process_table=not args.other_hosts) as wd:
        for k in range(args.steps):
            wd.step(k)
            if k == 0:
                time.sleep(args.slow_first)
            if rank == args.fault_rank and k == args.at and args.fault != "none":
                print(f"rank {rank} {args.fault} at step {k} t={time.time():.3f}", flush=True)
                if args.fault == "raise":
                    raise ValueError("injected failure in a pipeline stage")
                if args.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.fault == "stall":
                    while True:
                        time.sleep(1)
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world
            time.sleep(args.step_s)
    print(f"rank {rank} finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
