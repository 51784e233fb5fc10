"""The test package puts the repository's folders on ``sys.path`` before any of its modules runs:
pytest imports ``tests.conftest`` through it, and the gloo workers' forkserver imports
``tests.worker_preload`` through it with Python's default path (3.11's ``forkserver.main``
imports the preload before it applies the parent's path), where ``import gpt`` would fail."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
