"""The parts of benchmarks/end_to_end.py, one idea each (the script's docstring says what
it measures): ``layouts`` reads the layout names, ``master_weights`` is the shared
mixed-precision optimizer, ``builders`` builds each framework's model, ``measure`` times a
layout, ``profile`` splits a profiled step into compute, communication, bubble and idle,
``report`` prints the table and the --check."""
import os
import sys

# examples/ (the bundled GPT: ``from gpt import GPT``) and the repository root (fxmegatron)
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
for _path in (_ROOT, os.path.join(_ROOT, "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
