"""Every family of tests/families.py at tp2 with sequence parallelism and at cp2 compiles to the
plan recorded in tests/data/plans/<family>.txt: the dump's ``plan.txt`` (layout, tensor-parallel
decisions, parameter placements, coverage) and ``collectives.txt`` (every collective, the ring's
steps under each cp attention), byte for byte; where cp2 refuses a family, its refusal message.

It pins what the tensor- and context-parallel engines produce today, so that a refactor of
either that changes a decision, a placement or a collective shows up here as a diff. Rank 0
only: the other ranks' text differs only in the rank named in the header and in the ring's
steps, both of which follow from the rank by formula. No process is launched: the compiler is
called with one rank's coordinates and named groups that nothing resolves.

To record the files again after an intended change, run this file with
``FXMEGATRON_RECORD_PLANS=1`` and review the diff in git.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os

import pytest

from fxmegatron.capture import capture
from fxmegatron.compiler import compile_captured
from fxmegatron.config import ParallelConfig
from fxmegatron.errors import ShardingError
from fxmegatron.io.dump import dump_program
from fxmegatron.mesh import Axis
from tests.families import FAMILIES, make_batch

DATA = os.path.join(os.path.dirname(__file__), "data", "plans")
RECORD = os.environ.get("FXMEGATRON_RECORD_PLANS") == "1"
LAYOUTS = {"tp2 sp": ({"tp": 2}, {"sequence_parallel": True}), "cp2": ({"cp": 2}, {})}
FILES = ("plan.txt", "collectives.txt")
MARK = "#### "      # a section header; no line of a dump starts with it


def rank0_texts(cap, sizes, options, tmp) -> dict:
    """{section: text} of rank 0's dump for one layout, or its refusal."""
    axes = {d: Axis() for d in ("dp", "pp", "tp", "cp")}
    axes.update({d: Axis(s, 0, f"job-{d}", tuple(range(s))) for d, s in sizes.items()})
    try:    # compile_captured transforms the graph in place: each layout its own copy
        prog = compile_captured(dataclasses.replace(cap, gm=copy.deepcopy(cap.gm)), axes, "meta",
                                ParallelConfig(**options))
    except ShardingError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}\n"}
    dump_program(str(tmp), prog, 0)
    out = {}
    for name in FILES:
        with open(os.path.join(tmp, "rank0", name), encoding="utf-8", newline="") as f:
            out[name] = f.read()
    return out


def family_text(name: str, tmp) -> str:
    fam = FAMILIES[name]
    cap = capture(fam.build(), make_batch(fam, 0))
    parts = []
    for layout, (sizes, options) in LAYOUTS.items():
        sub = tmp / layout.replace(" ", "_")
        for section, text in rank0_texts(cap, sizes, options, sub).items():
            parts.append(f"{MARK}{layout}: {section}\n{text}")
    return "".join(parts)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plan_and_collectives_are_unchanged(name, tmp_path):
    got = family_text(name, tmp_path)
    path = os.path.join(DATA, f"{name}.txt")
    if RECORD:
        os.makedirs(DATA, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(got)
    with open(path, encoding="utf-8", newline="") as f:
        want = f.read()
    if got != want:
        diff = difflib.unified_diff(want.splitlines(), got.splitlines(), f"recorded {name}.txt", "now", lineterm="")
        pytest.fail(f"{name}: the plan or collectives changed (FXMEGATRON_RECORD_PLANS=1 records them again "
                    "if that is intended):\n" + "\n".join(list(diff)[:60]))
