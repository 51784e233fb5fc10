"""Weights & Biases as one more place the trainer's rows go (``log.wandb``): rank 0 starts a
run in ``OUT/wandb`` (offline by default: nothing leaves the machine until ``wandb sync``),
with the whole config as the run's config, and logs each step's row at its step.

A resumed job is a new W&B run in the same group (the output folder's name), starting at the
resume step: W&B rewinds an existing run only on its server, which an offline run has not
reached, and logging the steps after the checkpoint again into the old run would be refused
as non-increasing steps."""
from __future__ import annotations

import importlib
import os
from typing import Dict, Optional

from fxmegatron.errors import ConfigError
from fxmegatron.train.metrics import TRAIN_COLUMNS

INSTALL = "pip install 'fxmegatron[wandb]'"


def require(where: str):
    """The wandb module, or a ConfigError saying how to get it (checked before any process group)."""
    try:
        return importlib.import_module("wandb")
    except ImportError as e:
        raise ConfigError(f"{where}: log.wandb = true needs the wandb package ({e}): {INSTALL}") from None


class WandbSink:
    """One W&B run for this process's part of the job; ``log`` takes the trainer's rows."""

    def __init__(self, out: str, project: str, mode: str, config: Dict, start_step: int, where: str):
        wandb = require(where)
        os.makedirs(out, exist_ok=True)
        name = os.path.basename(os.path.abspath(out))
        self.run = wandb.init(project=project, dir=out, mode=mode, config=config, group=name,
                              name=name if not start_step else f"{name} (resumed at step {start_step})",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, row: Dict) -> None:
        # None (no evaluation this step) and NaN (no MFU on the CPU) are not values to plot
        values = {("eval/" if k == "val_loss" else "train/" if k in TRAIN_COLUMNS else "perf/") + k: v
                  for k, v in row.items() if k != "step" and v is not None and v == v}
        self.run.log(values, step=row["step"])

    def close(self, failed: Optional[bool] = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
