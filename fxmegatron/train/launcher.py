"""``fxmegatron train CONFIG --nproc-per-node N``: torchrun's own launch (``--standalone``, this
host), run in this process, so that the job ends with the trainer's exit status and its workers'
lines alone.

torchrun itself ends with status 1 whatever a worker's status was, after logging each worker it
stopped and raising ``ChildFailedError``, whose report (a traceback and a table of every worker's
exit) runs to some 35 lines. Here the agent's log is silenced, the report is read rather than
printed, and the status is 2 when a worker ended with 2 (bad input: a config, data, checkpoint or
layout that does not fit), else 1; a worker ended by a signal is named in one line. Stopped by
SIGTERM (a preemption: the workers get it too, agree on a step, save and return 0), the status is 0
when every worker says it returned 0 (each writes its status to ``STATUS_DIR``: torchrun reports
workers it stopped as failed), else 128 + the signal. Several hosts: run torchrun on each
(docs/TRAINER.md); its status is then torchrun's.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from typing import List

from fxmegatron.train.status import BAD_INPUT, FAILED

STATUS_DIR = "FXMEGATRON_STATUS_DIR"


def report_status(code: int) -> int:
    """A worker's last act under ``launch``: its exit status where the launcher reads it."""
    folder = os.environ.get(STATUS_DIR)
    if folder and "RANK" in os.environ:
        with open(os.path.join(folder, f"rank-{os.environ['RANK']}"), "w") as f:
            f.write(str(code))
    return code


def _all_returned_zero(folder: str, nproc: int) -> bool:
    codes = []
    for r in range(nproc):
        try:
            with open(os.path.join(folder, f"rank-{r}")) as f:
                codes.append(int(f.read()))
        except (OSError, ValueError):
            return False
    return all(c == 0 for c in codes)


def _quiet_agent() -> None:
    # the agent's lines ("Sending process N closing signal SIGTERM", "failed (exitcode: 2)") say
    # what the workers' own lines and the status below already say
    for name in ["torch.distributed.elastic"] + [n for n in logging.root.manager.loggerDict
                                                 if n.startswith("torch.distributed.elastic.")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(nproc: int, worker_argv: List[str]) -> int:
    """Start ``python -m fxmegatron.train *worker_argv`` on ``nproc`` processes as
    ``torchrun --standalone --nproc-per-node nproc`` does; returns the job's exit status."""
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "fxmegatron.train", *worker_argv])
    _quiet_agent()
    with tempfile.TemporaryDirectory(prefix="fxmegatron-status-") as folder:
        os.environ[STATUS_DIR] = folder          # the workers inherit it
        try:
            return _run(run, args, folder, nproc)
        finally:
            os.environ.pop(STATUS_DIR, None)


def _run(run, args, folder: str, nproc: int) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
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
        return 0 if _all_returned_zero(folder, nproc) else 128 + int(sig.sigval)
    return 0
