"""``fxmegatron train CONFIG.toml`` (or ``python -m fxmegatron.train CONFIG.toml``), under torchrun:

    torchrun --standalone --nproc_per_node 4 -m fxmegatron.train examples/configs/gpt_tiny.toml
    fxmegatron train examples/configs/gpt_tiny.toml --dry-run     # the plan, without training
    fxmegatron train CONFIG.toml --set run.steps=50 --set layout.tp=2

The config's keys are listed in docs/TRAINER.md (and ``fxmegatron.train.config.KEYS``). Without
torchrun the run is one process. Exit status: 0 when the run finished (or stopped at SIGTERM with
a checkpoint), 2 for a bad config or data (one line on stderr, before any process group work), 1
for a failure during training (the watchdog's line names the rank and the step).
"""
from __future__ import annotations

import argparse
import sys
import time

T_START = time.perf_counter()

import torch.distributed as dist  # noqa: E402

from fxmegatron.errors import ConfigError, DataError  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, read_env  # noqa: E402

ONE_PROCESS_PORT = 29531


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="fxmegatron train", description="train a model from one TOML config")
    ap.add_argument("config", help="the TOML config file (keys: docs/TRAINER.md)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (parameters and memory per rank, the schedule) and exit without training")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key (repeatable); the value is read as TOML")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from fxmegatron.train.config import load as load_config
    from fxmegatron.train.setup import prepare
    env = read_env(one_process_port=ONE_PROCESS_PORT) if not args.dry_run else None
    lead = env is None or env.lead
    try:
        cfg = load_config(args.config, args.set)
        prep = prepare(cfg, None if args.dry_run else env.world)
    except (ConfigError, DataError) as e:
        # Only rank 0 reports and fails: the others end quietly, so one line says what is wrong
        # (torchrun ends them anyway as soon as rank 0 fails).
        if lead:
            print(f"fxmegatron train: error: {e}", file=sys.stderr, flush=True)
            return 2
        return 0
    if args.dry_run:
        from fxmegatron.train.dry_run import print_plan
        print_plan(prep)
        print(f"dry run: {time.perf_counter() - T_START:.1f} s", flush=True)
        return 0
    from fxmegatron.train.loop import train
    env = init_from_env(prep.cfg.run.device, env=env)
    code = train(prep, env, T_START)
    # a rank that tears gloo down while a peer still finishes its last collective can abort that
    # peer ("terminate called without an active exception"): leave together
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
