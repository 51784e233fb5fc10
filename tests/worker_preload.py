"""What the gloo workers' forkserver imports once, so that no worker imports it again.

Every module here is one that the multi-process tests import anyway (by the test's worker
function, by torch.export, aot_autograd's partitioner, checkpointing, HF's lazy model classes);
importing is all it does: no model is built and no thread is started before the fork.

The forkserver starts with Python's default ``sys.path`` (3.11's ``forkserver.main`` imports the
preload before it applies the parent's path): ``tests/__init__.py`` puts the repository's folders
on it. Without that, ``tests.models``' ``import gpt`` failed here, the failure left the forkserver
as an ImportError that ``forkserver.main`` ignores, and every worker imported transformers (and built its lazy import structure) again: 4-5 s of one
core a worker. tests/test_isolation.py checks that a worker starts with all of it imported."""
import importlib
import pkgutil

_MODULES = [
    "torch", "torch._dynamo", "torch._inductor", "torch._inductor.codecache", "torch.export",
    "torch._functorch.aot_autograd", "torch._functorch.partitioners", "networkx",
    "torch.distributed.checkpoint", "torch.distributed.elastic", "torch.distributed.pipelining",
    "sympy", "safetensors.torch", "transformers", "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto", "tests.models", "tests.helpers", "tests.families",
]


def _walk(package):
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        if not info.name.endswith("__main__"):  # a command: importing it runs it
            yield info.name


FAILED = []     # (module, error) of what could not be imported here


def _names():
    yield from _MODULES
    for package in ("fxmegatron", "tests.workers"):
        try:
            yield from _walk(package)
        except Exception as exc:  # noqa: BLE001  as below: the test that imports it fails, not this
            FAILED.append((package, repr(exc)))


def preload():
    for name in _names():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  a module that cannot load here loads (and fails) in the test
            FAILED.append((name, repr(exc)))


preload()
