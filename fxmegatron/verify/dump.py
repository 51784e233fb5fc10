"""``fxmegatron verify ... --dump DIR``: what ``fxmegatron train --dump`` writes, for each layout
verify checks, in DIR/<layout>/rankN (``layout_folder``: the report's layout name).

verify runs a layout's ranks as threads of one process and keeps of them only what it compares,
not the programs a job would run. So each rank's program is compiled here again as
``parallelize`` compiles it on that rank (``compiler.compile_captured``: the same road
``lower.rank.build_rank`` that verify's simulated ranks take, from a copy of one capture) and
written by the trainer's own writer (``io.dump.dump_program``); N is the rank's place in the
trainer's mesh (dp, pp, cp, tp, tp fastest). What differs from a job's dump: only the options
verify simulates are in it (``verify.VERIFIED``; not fuse, compile, fp8 or tp_comm_overlap), the
collectives name their mesh axis where a job names its process group, and the weights are
materialised on the CPU.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import os

import torch
import torch.nn as nn

from fxmegatron.capture import capture
from fxmegatron.compiler import compile_captured, first_microbatch
from fxmegatron.io.dump import dump_program
from fxmegatron.layout import Layout
from fxmegatron.lower.rank import rank_axes

# no process group here: each axis's collectives are bound to its name, which the dump then shows
GROUPS = {"tp": "tp", "cp": "cp", "dp_cp": "dp_cp", "dp_replicate": "dp_replicate"}


def layout_folder(lay: Layout) -> str:
    from fxmegatron.verify import layout_name
    return layout_name(lay).replace(" ", "_")


def dump_layout(model: nn.Module, example_batch, layout: Layout, directory: str) -> str:
    """Every rank's program of ``layout`` (its ``verify.VERIFIED`` fields) for ``model`` (real or
    meta weights) and the global batch ``example_batch``, written to
    ``directory/<layout_folder>/rankN``; returns that folder."""
    from fxmegatron.verify import VERIFIED
    lay = Layout(**{n: getattr(layout, n) for n in VERIFIED})
    out = os.path.join(directory, layout_folder(lay))
    cap = capture(model, first_microbatch(example_batch, lay.microbatches, lay.dp))
    for rank, (d, p, c, t) in enumerate(itertools.product(range(lay.dp), range(lay.pp), range(lay.cp),
                                                          range(lay.tp))):
        axes = rank_axes(lay, {"dp": d, "pp": p, "cp": c, "tp": t}, GROUPS)
        own = dataclasses.replace(cap, gm=copy.deepcopy(cap.gm))     # compile_captured rewrites its graph
        dump_program(out, compile_captured(own, axes, torch.device("cpu"), lay), rank)
    return out
