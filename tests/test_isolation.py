"""tests/conftest.py puts back what a test changed in the process that later files depend on
(the thread count: see ``_keep_the_thread_count``). The two tests run in this order, on one
worker (``--dist loadfile``). And the gloo workers of tests/distributed.py start with torch,
transformers and fxmegatron imported (their forkserver's preload), not importing them again."""
import torch

from tests.distributed import run_distributed
from tests.workers.common import preload_state

START = torch.get_num_threads()


def test_a_test_that_changes_the_thread_count():
    torch.set_num_threads(START + 1)
    assert torch.get_num_threads() == START + 1


def test_the_next_test_has_the_thread_count_back():
    assert torch.get_num_threads() == START


def test_gloo_workers_start_with_the_preload_imported():
    """The forkserver once imported none of it (an ImportError of ``gpt`` in the preload, which
    Python's forkserver ignores) and the suite ran 20% longer; nothing else would notice."""
    for state in run_distributed(preload_state, 2):
        assert state == {"preloaded": True, "failed": [], "transformers": True, "gpt": True}, state
