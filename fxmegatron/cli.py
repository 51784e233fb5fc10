"""``fxmegatron`` command line.

    fxmegatron train CONFIG.toml [--dry-run] [--set section.key=value]   (under torchrun: see fxmegatron.train.main)
    fxmegatron train CONFIG.toml --nproc-per-node 4    (torchrun's launch in this process; exit 2: bad input, 1: failure)
    fxmegatron export CHECKPOINT OUTDIR      (a trainer checkpoint -> a Hugging Face folder)
    fxmegatron eval CONFIG.toml|CHECKPOINT|MODEL_DIR [--data FILE ... --data-kind K --tokenizer T --seq-len S
                    --batch B] [--batches N] [--set section.key=value] [--device cuda] [--json]   (held-out loss)
    fxmegatron generate CONFIG.toml|CHECKPOINT|MODEL_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                        [--top-p P] [--seed S] [--json]        (one process; greedy unless --temperature > 0)

    fxmegatron verify --factory FILE.py:FUNCTION --tp 2,4 [--sequence-parallel both] [--recompute full]
                      [--pp 1,2 --virtual-stages 2 --microbatches 4 --dp 2] [--cp 2 [--cp-attention allgather]]
    fxmegatron verify CONFIG.toml [--set section.key=value]   (the trainer's model, batch and layout)
    fxmegatron verify ... --dump DIR     (each rank's graphs and plan per layout, as train --dump: DIR/<layout>/rankN)
    fxmegatron compile --factory FILE.py:FUNCTION --pp 2 --tp 2 --microbatches 4 --out FOLDER
    torchrun --nproc_per_node 4 -m fxmegatron.launch FOLDER --data text.txt --steps 100

``compile`` takes every layout option as a flag (``Layout.add_arguments``: --sequence-parallel,
--recompute, --tp-comm-overlap N, --precision fp8, ...; the mesh is pp x tp) and calls
FUNCTION() -> (model, example_batch) (the batch of one training step;
with data parallelism, of one data-parallel rank times dp), then runs ``parallelize``
on pp*tp local gloo processes on CPU and writes each rank's stage modules (Python
source) and weights (safetensors) to FOLDER: see ``fxmegatron.io.stage_folder``.
``verify`` runs every rank of each layout (each pp size times each tp size; the example
batch is the global batch, split over dp and into microbatches) in this process on
simulated ranks and compares the loss and every gradient with the model run in eager, on
a fresh batch: it prints a report per layout, or names the first node that differs and
the rule that placed it, or the pipeline chunk and parameter (exit status 1). Give it a
tiny config of the model: it takes seconds. With a trainer config instead of ``--factory``, it
checks that run's model (built or loaded as the trainer does), its first batch and its
``[layout]`` (the layout flags are then the config's, not given).
``schedule`` draws a pipeline schedule (``python -m fxmegatron.schedules.draw``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from fxmegatron.factory import load_factory
from fxmegatron.layout import CP_ATTENTIONS, RECOMPUTE_MODES, SCHEDULE_NAMES, Layout
from fxmegatron.runtime.sharded_dp import DP_SHARD_MODES


# the options a stage folder is written for: its stage.py is the generated source of plain ATen
# chunks; fused kernels, torch.compile, FP8 and the merged linears of tp_comm_overlap have no
# written form tested yet (tests/test_layout.py lists the rest)
FOLDER_OPTIONS = ("sequence_parallel", "recompute", "microbatches", "virtual_stages", "schedule", "blocks_per_chunk")


def _compile_worker(rank, world, args, tmp):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fxmegatron
    from fxmegatron.io.stage_folder import write_folder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    model, batch = load_factory(args.factory)()
    mesh = init_device_mesh("cpu", (args.pp, args.tp), mesh_dim_names=("pp", "tp"))
    lay = Layout.from_args(args, seed=args.seed)
    pm = fxmegatron.parallelize(model, mesh, batch, **lay.options(), _chunked=True)
    write_folder(pm, args.out)
    dist.barrier()
    dist.destroy_process_group()


def compile_main(argv):
    ap = argparse.ArgumentParser(prog="fxmegatron compile",
                                 description="write each rank's stage modules and weights to a folder")
    ap.add_argument("--factory", required=True, help="FILE.py:FUNCTION returning (model, example_batch)")
    Layout.add_arguments(ap, degrees=("pp", "tp"), options=FOLDER_OPTIONS)      # the mesh is pp x tp
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    lay = Layout.from_args(args, seed=args.seed)      # a bad layout fails here, before the processes start
    world = args.pp * args.tp
    t0 = time.time()
    print(f"fxmegatron compile: {args.factory} at {lay.describe()} ({world} processes) -> {args.out}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_compile_worker, args=(world, args, tmp), nprocs=world, join=True, start_method="spawn")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(args.out) for f in fs)
    print(f"wrote {len(files)} files in {time.time() - t0:.1f} s:")
    for f in files:
        print("  " + f)
    return 0


def _with_weights(prep, batch):
    """The trainer's model with the weights a run starts from: a model built on meta gets them
    from a one-process ``parallelize`` (the checkpoint's, or the seeded initialisation), given
    as export gives a checkpoint's (``train.export.load_into``: tied parameters stay one)."""
    import copy

    import fxmegatron
    from fxmegatron.train.export import load_into
    model = prep.source.model
    if not any(p.device.type == "meta" for p in model.parameters()):
        return model
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, batch, seed=prep.layout.seed,
                                state_dict=prep.source.state_dict)
    load_into(model, {k: v.detach().clone() for k, v in pm.full_state_dict().items()}, "verify")
    return model


def _dump(model, batch, lay, directory) -> int:
    """``--dump``: every rank's program of ``lay`` written as ``fxmegatron train --dump`` writes it
    (``verify.dump``), also after a failed check (what the dump is most wanted for); 1 if it fails."""
    from fxmegatron.errors import FxMegatronError
    from fxmegatron.verify.dump import dump_layout
    try:
        out = dump_layout(model, batch, lay, directory)
    except FxMegatronError as exc:
        print(f"FAILED dump to {directory}: {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"fxmegatron verify: the graph dump of every rank is in {out}/rank*", flush=True)
    return 0


def _verify_config(path: str, overrides, dump=None) -> int:
    """``verify`` of a trainer run: its model, the batch of its first step, its layout."""
    from fxmegatron.errors import ConfigError, DataError, FxMegatronError
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    from fxmegatron.verify import verify
    try:
        prep = prepare(load(path, overrides), None)
    except (ConfigError, DataError) as exc:
        print(f"fxmegatron verify: error: {exc}", file=sys.stderr, flush=True)
        return 2
    batch = prep.batch(prep.train.windows(0), "cpu")
    model, failed = _with_weights(prep, batch), 0
    try:
        print(verify(model, batch, layout=prep.layout), flush=True)
    except FxMegatronError as exc:
        print(f"FAILED {path}: {type(exc).__name__}: {exc}", flush=True)
        failed = 1
    if dump:
        failed |= _dump(model, batch, prep.layout, dump)
    return failed


def verify_main(argv):
    ap = argparse.ArgumentParser(prog="fxmegatron verify",
                                 description="check parallel layouts against the model on simulated ranks")
    ap.add_argument("config", nargs="?", default=None,
                    help="a trainer config (TOML): verify its model, first batch and layout")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="with a config: override a key, as fxmegatron train --set")
    ap.add_argument("--factory", default=None, help="FILE.py:FUNCTION returning (model, example_batch)")
    ap.add_argument("--tp", default="2", help="tensor-parallel sizes, comma-separated (default 2)")
    ap.add_argument("--pp", default="1", help="pipeline sizes, comma-separated (default 1)")
    ap.add_argument("--virtual-stages", type=int, default=1, help="pipeline chunks per pipeline rank")
    ap.add_argument("--microbatches", type=int, default=1, help="microbatches per step")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (the example batch is the global one)")
    ap.add_argument("--schedule", default=None, choices=SCHEDULE_NAMES)
    ap.add_argument("--blocks-per-chunk", default=None, type=lambda s: tuple(int(x) for x in s.split(",")),
                    help="blocks of each pipeline chunk, comma-separated")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (each holds two chunks of the sequence)")
    ap.add_argument("--cp-attention", default="ring", choices=CP_ATTENTIONS)
    ap.add_argument("--sequence-parallel", default="off", choices=["off", "on", "both"])
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES)
    ap.add_argument("--dp-shard", default="none", choices=DP_SHARD_MODES,
                    help="what the dp (and cp) ranks shard; 'full' is simulated with every rank's shards")
    ap.add_argument("--dp-replicate", type=int, default=1,
                    help="hybrid sharding: the dp ranks in this many groups, each sharding over its own ranks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump", metavar="DIR", default=None,
                    help="also write each rank's transformed graph(s), placements, plan and collectives of every "
                         "layout to DIR/<layout>/rankN, as fxmegatron train --dump does")
    args = ap.parse_args(argv)
    if (args.config is None) == (args.factory is None):
        ap.error("give a trainer config (CONFIG.toml) or --factory FILE.py:FUNCTION, one of them")
    import copy

    import torch

    from fxmegatron.errors import FxMegatronError
    from fxmegatron.verify import layout_name, verify

    torch.set_num_threads(min(4, os.cpu_count() or 1))
    if args.config is not None:
        return _verify_config(args.config, args.set, args.dump)
    model, batch = load_factory(args.factory)()
    sps = {"off": [False], "on": [True], "both": [False, True]}[args.sequence_parallel]
    failed = 0
    for pp in [int(p) for p in args.pp.split(",")]:
        for tp in [int(t) for t in args.tp.split(",")]:
            for sp in sps:
                lay = None
                try:
                    lay = Layout(tp=tp, pp=pp, virtual_stages=args.virtual_stages, microbatches=args.microbatches,
                                 dp=args.dp, sequence_parallel=sp, recompute=args.recompute, schedule=args.schedule,
                                 blocks_per_chunk=args.blocks_per_chunk, seed=args.seed, cp=args.cp,
                                 cp_attention=args.cp_attention, dp_shard=args.dp_shard,
                                 dp_replicate=args.dp_replicate)
                    print(verify(copy.deepcopy(model), batch, layout=lay), flush=True)
                except FxMegatronError as exc:
                    failed += 1
                    name = layout_name(lay) if lay is not None else f"tp={tp} pp={pp}"
                    print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
                if args.dump and lay is not None:
                    failed += _dump(copy.deepcopy(model), batch, lay, args.dump)
    return 1 if failed else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "compile":
        return compile_main(rest)
    if cmd == "verify":
        return verify_main(rest)
    if cmd == "train":
        from fxmegatron.train.main import main as train
        return train(rest)
    if cmd == "export":
        from fxmegatron.train.export import main as export
        return export(rest)
    if cmd == "eval":
        from fxmegatron.train.evaluate import main as evaluate
        return evaluate(rest)
    if cmd == "generate":
        from fxmegatron.train.generate import main as generate
        return generate(rest)
    if cmd == "launch":
        from fxmegatron.launch import main as launch
        return launch(rest)
    if cmd == "schedule":
        from fxmegatron.schedules.draw import main as draw
        return draw(rest)
    # a usage error, as argparse's: status 2 (SystemExit with a message would give 1)
    print(f"fxmegatron: unknown command {cmd!r} (train, export, eval, generate, verify, compile, "
          "launch, schedule)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
