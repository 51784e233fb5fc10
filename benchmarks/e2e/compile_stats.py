"""What torch.compile did while a row ran: graph breaks (and their reasons), recompilations and
graphs compiled, from dynamo's process-wide counters.

The counters only grow over the process (``torch._dynamo.reset()`` after each row does not clear
``counters``), and the rows run one after another in it, so a row gets the differences over the
spans it ran in (``with stats:`` around its build, warm-up, timed and profiled steps), summed:
with --interleave the rows' spans alternate and each still sees only its own. What dynamo counts
is reported, fxmegatron's own torch.compile of its graph modules included:

- graph breaks: ``counters["graph_break"]``, one per break each time dynamo traces a frame
  (a frame compiled twice that breaks once counts 2); its keys are the messages, cut here to
  their first line;
- recompilations: torch keeps no counter of them (neither 2.11 nor 2.13 has
  ``counters["recompiles"]``), so they are counted from ``convert_frame.FRAME_COMPILE_COUNTER``
  (compiles per frame): every compile of a frame after its first, the ``/1``, ``/2`` ... of
  dynamo's compile ids ``[0/1]``;
- graphs: ``counters["stats"]["unique_graphs"]``, the FX graphs dynamo handed to a backend.
"""
from __future__ import annotations

from collections import Counter

import torch.distributed as dist

REASON_CHARS = 80


def short_reason(msg: str) -> str:
    """A graph break's message cut to its first line (torch 2.13 puts the kind of break there,
    the explanation and hints after), at most REASON_CHARS characters."""
    line = next((ln.strip() for ln in str(msg).splitlines() if ln.strip()), "")
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


def recompiles_so_far() -> int:
    """Compiles of frames after their first, for the frames compiled since the last reset."""
    from torch._dynamo import convert_frame
    per_frame = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None) or {}
    return sum(max(0, n - 1) for n in per_frame.values())


def snapshot():
    """(graph break messages -> count, graphs compiled, recompilations) as the counters stand."""
    from torch._dynamo.utils import counters
    # .get: reading a missing key of the defaultdict would add it
    return (dict(counters.get("graph_break", {})), counters.get("stats", {}).get("unique_graphs", 0),
            recompiles_so_far())


class CompileStats:
    """The counters' differences summed over the spans this is entered for."""

    def __init__(self):
        self.breaks = Counter()
        self.graphs = 0
        self.recompiles = 0
        self.start = None

    def __enter__(self):
        self.start = snapshot()
        return self

    def __exit__(self, *exc):
        (b0, g0, r0), (b1, g1, r1) = self.start, snapshot()
        for msg, n in b1.items():
            # dynamo takes a break back out of the counter when it restarts the frame's analysis
            self.breaks[msg] += max(0, n - b0.get(msg, 0))
        self.graphs += max(0, g1 - g0)
        # a torch._dynamo.reset() inside the span empties FRAME_COMPILE_COUNTER: then only the
        # recompilations after it are counted
        self.recompiles += r1 - r0 if r1 >= r0 else r1
        return False

    def fields(self) -> dict:
        """This rank's counts and reasons (the most frequent first, duplicates after cutting merged)."""
        reasons = Counter()
        for msg, n in self.breaks.items():
            if n > 0:
                reasons[short_reason(msg)] += n
        return {"graph_breaks": sum(reasons.values()), "graph_break_reasons": [r for r, _ in reasons.most_common()],
                "recompilations": self.recompiles, "graphs_compiled": self.graphs}


def over_ranks(fields: dict) -> dict:
    """Every rank's ``fields`` as one row's: each count the largest over the ranks (the ranks of a
    tensor-parallel group compile the same graphs, pipeline stages each their own), the reasons of
    all (rank 0's first). A collective: every rank calls it."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, fields)
    out = {key: max(f[key] for f in every) for key in ("graph_breaks", "recompilations", "graphs_compiled")}
    out["graph_break_reasons"] = list(dict.fromkeys(r for f in every for r in f["graph_break_reasons"]))
    return out


def describe(row: dict) -> str:
    """The line printed after the table for a row."""
    line = (f"compile: {row['layout']}: {row['graph_breaks']} graph breaks, {row['recompilations']} recompilations, "
            f"{row['graphs_compiled']} graphs; SDPA: {row.get('sdpa_backend', 'not profiled')}")
    reasons = row["graph_break_reasons"]
    if reasons:
        more = f" (+{len(reasons) - 3} more)" if len(reasons) > 3 else ""
        line += "; breaks: " + " | ".join(reasons[:3]) + more
    return line
