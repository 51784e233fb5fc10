"""``fxmegatron train CONFIG.toml`` (or ``python -m fxmegatron.train CONFIG.toml``), under torchrun:

    torchrun --standalone --nproc_per_node 4 -m fxmegatron.train examples/configs/gpt_tiny.toml
    fxmegatron train examples/configs/gpt_tiny.toml --dry-run     # the plan, without training
    fxmegatron train CONFIG.toml --set run.steps=50 --set layout.tp=2
    fxmegatron train CONFIG.toml --nproc-per-node 4               # torchrun's launch, in this process

The config's keys are listed in docs/TRAINER.md (and ``fxmegatron.train.config.KEYS``). Without
torchrun (or ``--nproc-per-node``) the run is one process. Exit status of each process: 0 when the
run finished (or stopped at SIGTERM with a checkpoint); 2 for bad input: a config, data or device
that does not fit (one line on stderr from each host's first process, which ends with 2, before any
process group work; under torchrun the others wait for it to end them), or a model, layout or
checkpoint that does not (one line from the watchdog, naming the rank); 1 for a failure during
training (the watchdog's line names the rank and the step). torchrun ends with 1 whatever its
workers' statuses; ``--nproc-per-node`` ends with theirs (2 or 1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_START = time.perf_counter()

import torch.distributed as dist  # noqa: E402

from fxmegatron.errors import ConfigError, DataError  # noqa: E402
from fxmegatron.runtime.distributed import init_from_env, read_env  # noqa: E402
from fxmegatron.train.status import BAD_INPUT  # noqa: E402

ONE_PROCESS_PORT = 29531
LOCAL_RANK_0_GRACE_S = 60.0
TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"     # set by torchrun's agent in every worker it starts


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="fxmegatron train", description="train a model from one TOML config",
                                 allow_abbrev=False)
    ap.add_argument("config", help="the TOML config file (keys: docs/TRAINER.md)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (parameters and memory per rank, the schedule) and exit without training")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key (repeatable); the value is read as TOML")
    ap.add_argument("--dump", metavar="DIR", default=None,
                    help="every rank writes its transformed graph(s), placements, plan and collectives to "
                         "DIR/rankN after parallelize (the config's log.dump)")
    ap.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                    help="start N processes on this host (torchrun --standalone, in this process) and end with "
                         "the job's status: 2 for bad input, 1 for a failure (torchrun: always 1)")
    return ap.parse_args(argv)


def _launch(args, argv) -> int:
    if args.dry_run or "RANK" in os.environ or args.nproc_per_node < 1:
        print("fxmegatron train: error: --nproc-per-node N starts N processes itself: give N >= 1, without "
              "--dry-run and not under torchrun", file=sys.stderr, flush=True)
        return BAD_INPUT
    from fxmegatron.train.launcher import launch
    rest, skip = [], False
    for a in argv:           # the workers get the same arguments but this one
        if skip or a.startswith("--nproc-per-node"):
            skip = not skip and a == "--nproc-per-node"
            continue
        rest.append(a)
    return launch(args.nproc_per_node, rest)


def _leave_the_line_to_local_rank_0(line: str):
    """torchrun ends every worker once one has failed: had this rank returned at once, local rank 0
    could be killed before it printed its line. Bad input is a function of the config, the world
    size and the host, so local rank 0 meets the same error, prints it and ends with 2, and torchrun
    ends this process then. Only if it does not (an error of this rank alone) does this rank print
    ``line`` after ``LOCAL_RANK_0_GRACE_S``. Outside torchrun (srun starting each process) nothing
    would end it: it returns at once, silent, as before."""
    time.sleep(LOCAL_RANK_0_GRACE_S)
    print(f"fxmegatron train: error: {line}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.nproc_per_node is not None:
        return _launch(args, argv)
    from fxmegatron.train.config import load as load_config
    from fxmegatron.train.setup import check_devices, prepare
    env = read_env(one_process_port=ONE_PROCESS_PORT) if not args.dry_run else None
    try:
        sets = args.set + ([f"log.dump = {json.dumps(os.path.abspath(args.dump))}"] if args.dump else [])
        cfg = load_config(args.config, sets)
        if env is not None:
            check_devices(cfg, env.local_world)
        prep = prepare(cfg, None if args.dry_run else env.world)
    except (ConfigError, DataError) as e:
        # one process per host says why: the same line from every rank would only repeat it
        if env is None or env.local_rank == 0:
            print(f"fxmegatron train: error: {e}", file=sys.stderr, flush=True)
        elif TORCHRUN_WORKER in os.environ:
            _leave_the_line_to_local_rank_0(str(e))
        return BAD_INPUT
    if args.dry_run:
        from fxmegatron.errors import FxMegatronError
        from fxmegatron.train.dry_run import print_plan
        try:
            print_plan(prep)
        except FxMegatronError as e:    # a layout the plan does not count (layout.ep > 1): one line
            print(f"fxmegatron train: error: --dry-run: {e}", file=sys.stderr, flush=True)
            return BAD_INPUT
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
