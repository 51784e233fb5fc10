"""One-process helpers: capture a model and run the tensor-parallel pass for a given rank."""
from fxmegatron.capture import capture, module_path
from fxmegatron.passes.tensor_parallel import apply_tensor_parallel, plan_tensor_parallel


def transform(model, batch, tp, rank=0, sequence_parallel=False):
    """(captured, plan, graph) for ``rank`` of ``tp``; no process group needed."""
    cap = capture(model, batch)
    plan = plan_tensor_parallel(cap.gm, tp, cap.params.keys(), sequence_parallel)
    apply_tensor_parallel(cap.gm, plan, rank, "tp")
    return cap, plan, cap.gm


def decisions(plan):
    """module path (or node name at the top level) -> the plan's Decision for its matmul,
    embedding or loss (the last one where a module has several)."""
    return {module_path(n) or n.name: d for n, d in plan.decisions.items()}


def train_once(model, batch, monkeypatch, disable=None, **kw):
    """(loss, {name: grad}, graph) of one ``train_step`` of ``parallelize(copy of model)`` at one
    process; ``disable``: the name of a pass function in ``fxmegatron.lower.rank_passes`` (which
    builds the pass list) to turn into a no-op."""
    import copy

    import fxmegatron
    import fxmegatron.lower.rank_passes
    with monkeypatch.context() as mp:
        if disable:
            mp.setattr(fxmegatron.lower.rank_passes, disable, lambda gm, *args: 0)
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, batch, **kw)
    loss = pm.train_step(batch)
    return loss, {n: p.grad for n, p in pm.named_parameters()}, pm.graph_module.graph


def assert_same_two_steps(name, fam, plain, other):
    """``other``'s losses and gradients are ``plain``'s (two ParallelModels of one family of
    tests/families.py) on two different batches with masked labels: loss 1e-5, gradients 1e-4."""
    import torch

    from tests.families import make_batch
    for seed in (1, 2):
        b = make_batch(fam, seed)
        b["labels"][0, :3] = -100
        runs = []
        for pm in (plain, other):
            for p in pm.parameters():
                p.grad = None
            loss = pm(b)
            loss.backward()
            runs.append((loss.item(), pm.full_grads()))
        (l0, g0), (l1, g1) = runs
        assert abs(l1 - l0) <= 1e-5 * abs(l0), (name, l1, l0)
        assert g1.keys() == g0.keys(), name
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
