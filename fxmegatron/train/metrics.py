"""What rank 0 shows and writes while training: a progress line (loss, tokens/s, TFLOP/s per
device, MFU, memory), OUT/loss.csv (every step, floats written exactly so runs can be compared
bit for bit), OUT/log.jsonl (the same rows as JSON lines, with ``log.jsonl``), TensorBoard event
files, W&B (``log.wandb``: ``wandb_sink.py``) and OUT/loss.png at the end. Steps count from 1, as
the console and the checkpoints do: row ``step`` N is the N-th optimizer step, and a checkpoint
step-N holds the weights after it."""
from __future__ import annotations

import csv
import json
import os
import resource
import sys
from typing import Dict, List, Optional

import torch

COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "mem_gib",
           "elapsed_s", "val_loss", "moe_imbalance"]
TRAIN_COLUMNS = ("loss", "lr", "grad_norm", "moe_imbalance")    # train/ panels; the rest but val_loss perf/


def peak_memory_gib(device: torch.device) -> float:
    """The device's peak allocated memory (cuda), else the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss      # KiB on Linux
    return kib / 2 ** 20


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that take part in a matmul per token: every module's 2-D ``weight`` except embedding
    lookups, once per module (a tied LM head counts, as it is a matmul of its own)."""
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Embedding) or not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        n += w.numel()
    return n


def flops_per_token(model: torch.nn.Module, seq_len: int, layers: Optional[int], hidden: Optional[int]) -> float:
    """Training FLOPs per token: 6·N (N = ``matmul_params``: forward 2·N, backward 4·N) plus causal
    attention, 6·L·S·H (QKᵀ and AV are 4·S·H per token and layer forward, times 3 with backward,
    halved because a causal mask skips half): Megatron's count with causal attention as half of
    full. Without layers and hidden (a factory model), the attention term is left out."""
    f = 6.0 * matmul_params(model)
    if layers and hidden:
        f += 6.0 * layers * seq_len * hidden
    return f


class Progress:
    """One line redrawn in place on a terminal, else a line every ``every`` steps."""

    def __init__(self, steps: int, every: int, start: int = 0):
        self.steps, self.start = steps, start
        self.tty = sys.stdout.isatty()
        self.every = every or max(1, steps // 10)
        self.width = 0

    def update(self, row: Dict) -> None:
        step = row["step"]          # counted from 1
        frac = step / self.steps
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = (f"[{bar}] step {step:>{len(str(self.steps))}}/{self.steps}  loss {row['loss']:.4f}  "
                f"lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  {row['tflops_per_device']:.2f} TFLOP/s/dev")
        if row["mfu"] == row["mfu"]:
            line += f"  MFU {row['mfu']:.1%}"
        line += f"  mem {row['mem_gib']:.2f} GiB  {row['elapsed_s']:6.1f} s"
        if row.get("moe_imbalance") is not None:
            line += f"  MoE imbalance {row['moe_imbalance']:.2f}"
        if self.tty:
            print("\r" + line.ljust(self.width), end="", flush=True)
            self.width = len(line)
        elif step % self.every == 0 or step == self.start + 1 or step == self.steps:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self.tty and self.width:
            print("\r" + text.ljust(self.width), flush=True)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.tty and self.width:
            print(flush=True)


def _fmt(v) -> str:
    if v is None:
        return ""
    return repr(float(v)) if isinstance(v, float) else str(v)


def _json_line(row: Dict) -> str:
    """loss.csv's columns as one JSON object: floats by repr (exact, as in loss.csv), an absent
    value as null, a non-finite one as Python's json writes it (NaN, Infinity)."""
    return json.dumps({c: row.get(c) for c in COLUMNS}) + "\n"


class Metrics:
    """OUT/loss.csv, appended and flushed every step (a killed run leaves its rows); a resumed run
    keeps the rows of the steps its checkpoint holds (step <= the resume step) and rewrites the rest.
    With ``jsonl``, OUT/log.jsonl holds the same rows, written alongside: on resume it is rewritten
    from loss.csv's kept rows, so the two agree row by row whatever happened to either before.
    TensorBoard events in OUT/tensorboard (``tensorboardX``), purged past the resume step the same way."""

    def __init__(self, out: str, start_step: int, tensorboard: bool, jsonl: bool = False, wandb=None):
        os.makedirs(out, exist_ok=True)
        self.wandb = wandb        # a WandbSink (log.wandb), or None
        self.path = os.path.join(out, "loss.csv")
        self.jsonl = os.path.join(out, "log.jsonl") if jsonl else None
        self.rows: List[Dict] = []
        if start_step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as f:
                # a column the file lacks (written before it was added) reads as None
                old = [{k: (None if v is None or v == "" else int(v) if k == "step" else float(v))
                        for k, v in r.items()}
                       for r in csv.DictReader(f)]
            # fxmegatron before steps counted from 1 wrote 0 for the first step: renumber such a file,
            # or the kept rows would hold one step too many
            shift = 1 if old and old[0]["step"] == 0 else 0
            self.rows = [{**r, "step": r["step"] + shift} for r in old if r["step"] + shift <= start_step]
        with open(self.path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for r in self.rows:
                w.writerow([_fmt(r.get(c)) for c in COLUMNS])
        if self.jsonl:
            with open(self.jsonl, "w") as f:
                f.writelines(_json_line(r) for r in self.rows)
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            # events of the steps after the resume step (from start_step + 1) are rewritten
            self.tb = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, row: Dict) -> None:
        self.rows.append(row)
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([_fmt(row.get(c)) for c in COLUMNS])
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(_json_line(row))
        if self.tb is not None:
            s = row["step"]
            for c in COLUMNS[1:]:
                v = row.get(c)
                if c != "val_loss" and v is not None and v == v:
                    self.tb.add_scalar(("train/" if c in TRAIN_COLUMNS else "perf/") + c, v, s)
            if row.get("val_loss") is not None:
                self.tb.add_scalar("eval/loss", row["val_loss"], s)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(row)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None

    def plot(self, path: str, title: str) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        ax.plot([r["step"] for r in self.rows], [r["loss"] for r in self.rows], lw=1.2, label="train loss")
        val = [(r["step"], r["val_loss"]) for r in self.rows if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o-", ms=4, lw=1, label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats per token)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
