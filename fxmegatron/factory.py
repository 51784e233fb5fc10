"""``FILE.py:FUNCTION`` or ``package.module:FUNCTION``: how the CLI and the trainer name a user's
model factory."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def load_factory(spec: str):
    """The function ``spec`` names (importing its file or module)."""
    if ":" not in spec:
        raise SystemExit(f"--factory {spec!r}: expected FILE.py:FUNCTION or MODULE:FUNCTION")
    where, fn = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = os.path.abspath(where)
        sys.path.insert(0, os.path.dirname(path))
        s = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    return getattr(mod, fn)
