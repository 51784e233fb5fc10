"""Ranks whose kernels round a replicated weight's gradient differently (tests/test_same_grads.py)."""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fxmegatron.ops.collectives import mean_grad
from fxmegatron.placement import R


class _Jitter(torch.autograd.Function):
    """Identity forward; the gradient scaled by ``1 + eps`` backward: a kernel whose rounding
    depends on the order its threads add in, as a scatter-add's on a GPU."""

    @staticmethod
    def forward(ctx, x, eps):
        ctx.eps = eps
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * (1 + ctx.eps), None


def jitter(x, eps):
    return _Jitter.apply(x, eps)


def _plant(gm, placement, eps):
    """Every computation that reads a weight replicated over tp gets the gradient it gives the
    weight scaled on this rank (the weight followed through casts, views and collectives to
    those readers: where a kernel rounds)."""
    from fxmegatron.passes.tensor_parallel.same_grads import SAME_ON_EVERY_RANK, weights_only
    through = (mean_grad, *SAME_ON_EVERY_RANK)
    todo = [n for n in gm.graph.nodes if n.op == "get_attr" and placement(n.target) == R]
    seen = set(todo)
    while todo:
        src = todo.pop()
        readers = []
        for u in list(src.users):
            if u.target in through or weights_only(u):
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
            else:
                readers.append(u)
        if readers:
            with gm.graph.inserting_after(src):
                j = gm.graph.call_function(jitter, (src, eps))
            for u in readers:
                u.replace_input_with(src, j)
    gm.recompile()


def replicated_grads(rank, world, family, layout, average=True):
    """For each weight replicated over tp that has a gradient: the largest difference between
    the ranks' gradients after one step whose backward rounds differently on each rank, and the
    names of the weights read through ``mean_grad``. ``average=False``: the pass off."""
    import fxmegatron
    import fxmegatron.lower.rank_passes as rank_passes
    from tests.families import FAMILIES, make_batch

    if not average:
        rank_passes.average_redundant_grads = lambda *a: []

    fam = FAMILIES[family]
    torch.manual_seed(0)
    model = fam.build()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = fxmegatron.parallelize(model, mesh, make_batch(fam, 0), **layout)
    gm = pm.graph_module
    averaged = sorted(u.args[0].target for u in gm.graph.nodes if u.target is mean_grad)
    _plant(gm, pm.placement, 1e-3 * rank)
    pm.train_step(make_batch(fam, 1))
    diffs = {}
    for name, p in pm.named_parameters():
        if pm.placement(name) != R or p.grad is None:
            continue
        every = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(every, p.grad.contiguous())
        diffs[name] = max(float((g - every[0]).abs().max()) for g in every)
    return diffs, averaged
