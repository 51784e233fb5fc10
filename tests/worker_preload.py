"""What the gloo workers' forkserver imports once, so that no worker imports it again.

Every module here is one that the multi-process tests import anyway (by the test's worker
function, by torch.export, aot_autograd's partitioner, checkpointing, HF's lazy model classes);
importing is all it does: no model is built and no thread is started before the fork."""
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


def preload():
    for name in [*_MODULES, *_walk("fxmegatron"), *_walk("tests.workers")]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  a module that cannot load here loads (and fails) in the test
            pass


preload()
