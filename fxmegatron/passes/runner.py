"""One pass protocol and the runner that applies a list of passes (the idea of torch.fx's
``PassManager``, with stated pre- and postconditions and a shape check).

A pass is a function ``GraphModule -> GraphModule`` (it may change the module in place;
whatever else it returns, a count of rewrites say, means "in place"), wrapped in a ``Pass`` that names it and
states the graph properties it ``requires`` (ensured by an earlier pass) and
``ensures``. The runner checks the order, lints and recompiles after every pass (so a
pass needs no tail of its own), times each, and with ``debug=True`` propagates fake
tensors through the graph after every pass: a pass that leaves a shape inconsistent is
named, with the passes that ran before it, instead of surfacing as an error far away.
Properties are plain strings ("tp_rewritten", "local_shapes", ...): they document the
order and catch a list assembled wrongly; they are not proofs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxmegatron.errors import FxMegatronError, PassError
from fxmegatron.capture.export import module_path


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[fx.GraphModule], Optional[fx.GraphModule]]
    requires: FrozenSet[str] = frozenset()
    ensures: FrozenSet[str] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "requires", frozenset(self.requires))
        object.__setattr__(self, "ensures", frozenset(self.ensures))


def check_shapes(gm: fx.GraphModule) -> None:
    """Propagate fake tensors shaped like the placeholders' ``meta["val"]`` through ``gm``
    (on the device of its parameters); every node gets its value in ``meta["val"]``.
    Raises what the failing op raises."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dev = next((p.device for p in gm.parameters()), torch.device("cpu"))
    inputs = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            inputs.append(mode.from_tensor(v).to(dev) if isinstance(v, torch.Tensor) else v)
    with mode:
        _NamingProp(gm, mode).propagate(*inputs)


class _NamingProp(FakeTensorProp):
    """FakeTensorProp whose failure carries, as a note, the node it failed at and its module."""

    def run_node(self, n: fx.Node):
        try:
            return super().run_node(n)
        except Exception as exc:
            if not any(note.startswith("at node ") for note in getattr(exc, "__notes__", ())):
                mod = module_path(n)
                exc.add_note(f"at node {n.name} ({getattr(n.target, '__name__', n.target)})"
                             + (f" in {mod}" if mod else ""))
            raise


class PassRunner:
    """Applies ``passes`` in order; ``timings`` holds seconds per pass after a run."""

    def __init__(self, passes: Sequence[Pass], *, debug: bool = False, given: Iterable[str] = ()):
        self.passes = list(passes)
        self.debug = debug
        self.given = frozenset(given)
        self.timings: Dict[str, float] = {}

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        have = set(self.given)
        done: List[str] = []
        for p in self.passes:
            missing = p.requires - have
            if missing:
                raise PassError(f"pass {p.name!r} requires {sorted(missing)}, which no pass before it "
                                f"ensures ({self._history(done)})")
            t0 = time.perf_counter()
            try:
                out = p.fn(gm)
            except FxMegatronError as exc:   # already names the node and the constraint
                exc.add_note(f"in pass {p.name!r} ({self._history(done)})")
                raise
            except Exception as exc:
                raise PassError(f"pass {p.name!r} failed ({self._history(done)}): {type(exc).__name__}: "
                                f"{_first_line(exc)}") from exc
            gm = out if isinstance(out, fx.GraphModule) else gm
            try:
                gm.graph.lint()
            except Exception as exc:
                raise PassError(f"pass {p.name!r} left a malformed graph ({self._history(done)}): "
                                f"{_first_line(exc)}") from exc
            gm.recompile()
            if self.debug:
                try:
                    check_shapes(gm)
                except Exception as exc:
                    raise PassError(f"pass {p.name!r} left the graph's shapes inconsistent "
                                    f"({self._history(done)}): {type(exc).__name__}: {_first_line(exc)}") from exc
            self.timings[p.name] = self.timings.get(p.name, 0.0) + time.perf_counter() - t0
            have |= p.ensures
            done.append(p.name)
        return gm

    @staticmethod
    def _history(done: List[str]) -> str:
        return "after " + ", ".join(done) if done else "the first pass"


def _first_line(exc: BaseException) -> str:
    s = str(exc)
    return s.splitlines()[0] if s else ""
