"""ops/own_thread.py reads torch.compile's CUDA-graph tree (``_in_graph_warmup``) to copy the
worker's results onto the caller's thread during a graph's warm-up. Those are inductor's
internals: this checks, on any machine, that the names it reads are still there, so that a torch
that moved them fails here rather than quietly bringing back the refused step
(tests/test_compile_cuda.py runs the real case on a GPU)."""
import contextlib
import inspect

import torch

from fxmegatron.ops import own_thread


def test_the_graph_trees_internals_it_reads_exist():
    from torch._inductor import cudagraph_trees as trees
    containers = trees.get_obj(trees.local, "tree_manager_containers")
    assert isinstance(containers, dict)
    assert "self.tree_manager" in inspect.getsource(trees.TreeManagerContainer.__init__)
    manager_init = inspect.getsource(trees.CUDAGraphTreeManager.__init__)
    assert "self.stream =" in manager_init and "self.cuda_graphs_thread_pool =" in manager_init
    # the pool the warm-ups allocate into is that one, on that stream
    assert "_use_cuda_memory_pool_manager(" in inspect.getsource(trees.CUDAWarmupNode.run)


def test_outside_a_graph_tree_nothing_is_copied_or_created():
    from torch._inductor import cudagraph_trees as trees
    containers = trees.get_obj(trees.local, "tree_manager_containers")
    before = dict(containers)
    assert own_thread._in_graph_warmup(0, object()) is False
    assert containers == before


def test_in_a_warmup_results_are_copied_on_the_callers_thread(monkeypatch):
    """``on_own_thread``'s copy step, its worker replaced by a plain call (no CUDA here)."""
    import concurrent.futures
    a, b = torch.arange(3.0), torch.ones(2)
    monkeypatch.setattr(own_thread, "_worker", lambda index: concurrent.futures.ThreadPoolExecutor(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    for warm in (False, True):
        monkeypatch.setattr(own_thread, "_in_graph_warmup", lambda index, stream: warm)
        out = own_thread.on_own_thread(lambda: (a, [b, None], 7), torch.device("cuda", 0))
        assert torch.equal(out[0], a) and torch.equal(out[1][0], b) and out[1][1] is None and out[2] == 7
        assert (out[0].data_ptr() != a.data_ptr()) is warm and (out[1][0].data_ptr() != b.data_ptr()) is warm
