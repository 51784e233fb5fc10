"""The rule table: ATen op packet -> placement rule (``rules/__init__`` fills it by
importing every rule module, and looks rules up)."""
from __future__ import annotations

from typing import Callable, Dict

RULES: Dict[object, Callable] = {}


def register(*packets, name: str = ""):
    """Register ``rule(view, node) -> Outcome`` for the ops ``packets`` (``aten.mm``, ...). Its name,
    recorded in ``TPPlan.rules`` for the nodes it places unless it names a more precise
    outcome, is ``name`` or ``<module>.<function>`` (``views.view``)."""
    def deco(fn):
        module = fn.__module__.rsplit(".", 1)[-1]
        fn.rule_name = name or (module if module == fn.__name__ else f"{module}.{fn.__name__}")
        for pk in packets:
            if pk in RULES:
                raise ValueError(f"two placement rules for {pk}: {RULES[pk].rule_name} and {fn.rule_name}")
            RULES[pk] = fn
        return fn
    return deco
