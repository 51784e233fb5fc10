"""Layout names (``eager``, ``compile``, ``native-tpN``, ``fx-...``; see benchmarks/end_to_end.py's
docstring) parsed into ``Layout`` records and checked against the world size and the model."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from gpt import GPTConfig

MODELS = {  # layers, hidden, heads, seq, vocab, global batch
    "gpt1.3b": (24, 2048, 16, 2048, 50304, 8),
    "gpt6.7b": (32, 4096, 32, 2048, 50304, 16),
    "gpt13b": (40, 5120, 40, 2048, 50304, 32),
    # tiny: 8 layers so that fx-pp4-v2 has a block per chunk; batch 16 so that pipeline microbatches hold
    # 2 sequences: with 1, fxmegatron's gloo reduce-scatter returns a view of its input and fails
    "tiny": (8, 64, 4, 64, 512, 16),
}


@dataclass
class Layout:
    name: str
    kind: str                   # eager, compile, native, fx
    dp: int = 1
    pp: int = 1
    tp: int = 1
    v: int = 1
    m: int = 1
    schedule: Optional[str] = None
    sp: bool = True
    fuse: bool = False
    compile: object = False     # False, True or a torch.compile mode
    recompute: str = "none"
    fadam: bool = False
    fp32_accum: bool = False    # parallelize(grad_accum_dtype=torch.float32)
    overlap: int = 0
    transport: str = "auto"

    @property
    def world(self):
        return self.dp * self.pp * self.tp


def parse_layout(name: str, pp_microbatches: int) -> Layout:
    """``eager``, ``compile``, ``native-tpN``, ``fx-...`` (see end_to_end.py's docstring), each
    with an optional ``-mN``. Raises ValueError with the reason."""
    head, *tokens = name.split("-")
    if head not in ("eager", "compile", "native", "fx"):
        raise ValueError(f"layout {name!r}: starts with {head!r}; expected eager, compile, native-tpN or fx[-...]")
    lay = Layout(name, head)
    m = None
    for tok in tokens:
        num = re.fullmatch(r"(tp|pp|dp|v|m|ov)(\d+)", tok)
        if num and (head == "fx" or num.group(1) in ("tp", "m") and (head == "native" or num.group(1) == "m")):
            key, val = num.group(1), int(num.group(2))
            if val < 1:
                raise ValueError(f"layout {name!r}: {tok} must be >= 1")
            if key == "m":
                m = val
            elif key == "ov":
                lay.overlap = val
            else:
                setattr(lay, key, val)
        elif head == "fx" and tok in ("1f1b", "gpipe", "interleaved"):
            lay.schedule = tok
        elif head == "fx" and tok == "fuse":
            lay.fuse = True
        elif head == "fx" and tok == "compile":
            lay.compile = lay.compile or True
        elif head in ("fx", "compile") and tok in ("cgraphs", "autotune"):
            lay.compile = {"cgraphs": "reduce-overhead", "autotune": "max-autotune-no-cudagraphs"}[tok]
        elif head == "fx" and tok == "nosp":
            lay.sp = False
        elif head == "fx" and tok == "fadam":
            lay.fadam = True
        elif head == "fx" and tok == "acc32":
            lay.fp32_accum = True
        elif head == "fx" and tok in ("nccl", "ce"):
            lay.transport = {"nccl": "nccl", "ce": "copy_engine"}[tok]
        elif head == "fx" and tok in ("rsel", "rfull"):
            lay.recompute = {"rsel": "selective", "rfull": "full"}[tok]
        else:
            raise ValueError(f"layout {name!r}: unknown part {tok!r} for a {head} layout")
    if head == "native" and not any(t.startswith("tp") for t in tokens):
        raise ValueError(f"layout {name!r}: native needs its tensor-parallel size, e.g. native-tp4")
    lay.m = m if m is not None else (pp_microbatches if lay.pp > 1 else 1)
    lay.sp = lay.sp and lay.tp > 1
    return lay


def check_layout(lay: Layout, world: int, cfg: GPTConfig, batch: int) -> Optional[str]:
    """Why ``lay`` cannot run here, or None."""
    if lay.kind in ("eager", "compile") and world != 1:
        return (f"{lay.name} runs the whole model in one process; world size is {world}: run it in a separate "
                f"one-process job (python benchmarks/end_to_end.py --layouts {lay.name})")
    if lay.world != world:
        return (f"{lay.name} needs dp·pp·tp = {lay.dp}·{lay.pp}·{lay.tp} = {lay.world} processes, but the world "
                f"size is {world} (torchrun --nproc-per-node)")
    if batch % (lay.dp * lay.m):
        return f"{lay.name}: global batch {batch} is not divisible by dp·microbatches = {lay.dp}·{lay.m}"
    if lay.kind == "native" and (cfg.n_head % lay.tp or cfg.vocab_size % lay.tp or cfg.block_size % lay.tp):
        return f"{lay.name}: tp {lay.tp} must divide the heads ({cfg.n_head}), vocabulary and sequence length"
    if lay.kind == "fx" and lay.pp * lay.v > cfg.n_layer:
        return f"{lay.name}: pp·v = {lay.pp * lay.v} chunks but only {cfg.n_layer} layers"
    return None
