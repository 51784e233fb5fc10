"""tests/conftest.py puts back what a test changed in the process that later files depend on
(the thread count: see ``_keep_the_thread_count``). The two tests run in this order, on one
worker (``--dist loadfile``)."""
import torch

START = torch.get_num_threads()


def test_a_test_that_changes_the_thread_count():
    torch.set_num_threads(START + 1)
    assert torch.get_num_threads() == START + 1


def test_the_next_test_has_the_thread_count_back():
    assert torch.get_num_threads() == START
