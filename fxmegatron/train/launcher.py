"""``fxmegatron train CONFIG --nproc-per-node N``: torchrun's own launch (``--standalone``, this
host), run in this process, so that the job ends with the trainer's exit status and its workers'
lines alone.

torchrun itself ends with status 1 whatever a worker's status was, after logging each worker it
stopped and raising ``ChildFailedError``, whose report (a traceback and a table of every worker's
exit) runs to some 35 lines. Here the agent's log is silenced, the report is read rather than
printed, and the status is 2 when a worker ended with 2 (bad input: a config, data, checkpoint or
layout that does not fit), else 1; a worker ended by a signal is named in one line. Several hosts:
run torchrun on each (docs/TRAINER.md); its status is then torchrun's.
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import List

from fxmegatron.train.status import BAD_INPUT, FAILED


def _quiet_agent() -> None:
    # the agent's lines ("Sending process N closing signal SIGTERM", "failed (exitcode: 2)") say
    # what the workers' own lines and the status below already say
    for name in ["torch.distributed.elastic"] + [n for n in logging.root.manager.loggerDict
                                                 if n.startswith("torch.distributed.elastic.")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(nproc: int, worker_argv: List[str]) -> int:
    """Start ``python -m fxmegatron.train *worker_argv`` on ``nproc`` processes as
    ``torchrun --standalone --nproc-per-node nproc`` does; returns the job's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "fxmegatron.train", *worker_argv])
    _quiet_agent()
    try:
        run(args)
    except ChildFailedError as err:
        codes = {rank: f.exitcode for rank, f in err.failures.items()}
        # SIGTERM is how the agent stops the others; any other signal ended a worker from outside
        killed = sorted((f.timestamp, rank) for rank, f in err.failures.items()
                        if f.exitcode < 0 and -f.exitcode != signal.SIGTERM)
        for _, rank in killed[:1]:
            f = err.failures[rank]
            print(f"fxmegatron train: rank {rank} (pid {f.pid}) was ended by {signal.Signals(-f.exitcode).name}",
                  file=sys.stderr, flush=True)
        return BAD_INPUT if BAD_INPUT in codes.values() else FAILED
    except SignalException as sig:       # this launcher was stopped (the workers got the signal too)
        return 128 + int(sig.sigval)
    return 0
