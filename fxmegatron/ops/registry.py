"""One record per op that communicates, filled where the op is defined.

Each module of ``fxmegatron.ops`` that defines a graph function (a ``call_function`` target)
that talks to other ranks calls ``register`` for it, beside its definition. Readers ask
``record(node.target)``: the dump (``io.dump.collective_nodes``: its short name, whether this
call communicates, the lines under it), the pass that drops the collectives of a tensor-parallel
group of one (``passes.trivial_collectives``). A node's target is a function of a module that
was imported, so its record is there; there is no list of ops to keep in step elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Communicating:
    """What one graph function communicates."""

    op: Callable                        # the graph's call target
    name: str                           # its short name in the dump's collectives.txt
    description: str                    # what it communicates, forward and backward
    group_args: Tuple[int, ...]         # the positions of the arguments that name process groups
    steps: Tuple[str, ...] = ()         # a fused op's collectives in order (the dump: "name[max,g,g]")
    needs_group: bool = False           # communicates only where a group argument is not "" (none)
    identity_alone: bool = False        # the identity of its first argument on a group of one
    detail: Optional[Callable[[Sequence], str]] = None   # the node's args -> lines the dump prints under it

    @property
    def label(self) -> str:
        """The name the dump lists the node under."""
        return self.name + (f"[{','.join(self.steps)}]" if self.steps else "")

    def communicates(self, args: Sequence) -> bool:
        """Whether a call with these (positional) arguments talks to other ranks."""
        return not self.needs_group or any(args[i] for i in self.group_args)


_RECORDS: Dict[Callable, Communicating] = {}


def register(op: Callable, name: str, description: str, group_args: Sequence[int], *, steps: Sequence[str] = (),
             needs_group: bool = False, identity_alone: bool = False,
             detail: Optional[Callable[[Sequence], str]] = None) -> Communicating:
    """Record ``op`` (once: a second record of one op is a mistake)."""
    if op in _RECORDS:
        raise ValueError(f"{name}: {op!r} is registered already, as {_RECORDS[op].name!r}")
    rec = Communicating(op, name, description, tuple(group_args), tuple(steps), needs_group, identity_alone, detail)
    _RECORDS[op] = rec
    return rec


def record(target) -> Optional[Communicating]:
    """The record of a node's target, or None for an op that does not communicate."""
    try:
        return _RECORDS.get(target)
    except TypeError:       # an unhashable target
        return None


def records() -> Tuple[Communicating, ...]:
    """Every record so far (of the op modules imported), in registration order."""
    return tuple(_RECORDS.values())
