"""The trainer's checkpoints: DIR/step-NNNNNNNN folders written by ``fxmegatron.io.checkpoint``
(sharded, atomic, reshardable), every N steps, at the end and when the job is asked to stop
(SIGTERM, agreed by every rank at a step boundary so all of them save the same step); the last
K kept; ``resume = "auto"`` takes the latest complete one (a folder with its index.json, the
last file a save writes) at whatever layout it was saved."""
from __future__ import annotations

import os
import re
import shutil
import signal
from typing import List, Optional

import torch
import torch.distributed as dist

from fxmegatron.io import checkpoint
from fxmegatron.train.documents import save_tokenizer

_NAME = re.compile(r"^step-(\d{8})$")
_ANY = re.compile(r"^step-(\d{8})(\.tmp|\.old)?$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def complete(root: str) -> List[str]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.exists(os.path.join(root, name, "index.json")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [p for _, p in sorted(found)]


def skipped(root: str) -> List[str]:
    """Why each step folder under ``root`` that ``complete`` does not list is not taken, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _ANY.match(name)
        path = os.path.join(root, name)
        if not m or not os.path.isdir(path):
            continue
        has_index = os.path.exists(os.path.join(path, "index.json"))
        if not m.group(2) and has_index:
            continue            # complete: taken
        if m.group(2) == ".tmp" and not has_index:
            why = "a save cut off before its index.json"
        elif m.group(2) == ".old":
            why = "the copy a later save of that step replaces"
        elif has_index:
            why = f"complete but never renamed; rename it to step-{m.group(1)} to resume from it"
        else:
            why = "no index.json"
        out.append((int(m.group(1)), name, f"{path} ({why})"))
    return [text for _, _, text in sorted(out)]


def resume_from(root: str, resume: str) -> Optional[str]:
    """The folder to resume from: ``resume`` "none" -> None, "auto" -> the latest complete one
    under ``root`` (None when there is none), else ``resume`` itself. With "auto", rank 0 says
    which step folders it passed over and why: a run that starts afresh beside an unfinished
    save must not look like a resume that found nothing."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete(root)
        passed = skipped(root)
        if passed and (not dist.is_initialized() or dist.get_rank() == 0):
            then = f"resuming from {found[-1]}" if found else "no complete checkpoint: starting from step 0"
            print(f"fxmegatron train: checkpoint.resume = \"auto\" skipped {'; '.join(passed)}; {then}", flush=True)
        return found[-1] if found else None
    return resume


def save(pm, opt, root: str, step: int, keep: int, extra: dict, files: Optional[dict] = None) -> str:
    """Save after ``step`` steps (collective); ``files`` ({name in the folder: a tokenizer directory})
    get the tokenizer an export needs, and nothing else of that directory (``save_tokenizer``: a
    model folder's weights must not ride along); rank 0 then removes all but the last ``keep``."""
    path = step_dir(root, step)

    def write_files(folder: str) -> None:
        for name, src in (files or {}).items():
            save_tokenizer(src, os.path.join(folder, name))

    checkpoint.save(pm, opt, path, extra={**extra, "step": step}, write_files=write_files)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


class StopRequest:
    """SIGTERM (what torchrun forwards, and what schedulers send before a kill) sets a flag; ``agreed()`` is true on every rank once any rank saw one:
    a max over the default group at each step boundary, so the whole job saves the same step."""

    def __init__(self, device: torch.device):
        self.flag = False
        self.device = device
        self._old = {}
        for sig in (signal.SIGTERM,):
            self._old[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.flag = True

    def agreed(self) -> bool:
        t = torch.tensor([1.0 if self.flag else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
