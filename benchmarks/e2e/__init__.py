"""The parts of benchmarks/end_to_end.py, one idea each (the script's docstring says what
it measures): ``models`` is the model (GPT or Hugging Face), its batch, loss and FLOPs,
``layouts`` reads the layout names, ``optimizers`` the run's optimizer (``master_weights``
the torch one), ``builders`` (and ``hf_builders``) build each framework's model,
``measure`` times a layout, ``compile_stats`` counts its torch.compile graph breaks,
recompilations and graphs, ``profiling`` splits a profiled step into compute,
communication, bubble and idle, ``report`` prints the table and the --check."""
import os
import sys

# examples/ (the bundled GPT: ``from gpt import GPT``) and the repository root (fxmegatron)
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
for _path in (_ROOT, os.path.join(_ROOT, "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
