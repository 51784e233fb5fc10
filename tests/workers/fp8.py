"""FP8 linears at tp=world (``parallelize(precision="fp8")``): loss and whole gradients of one
step, to compare with the same FP8 program at world size 1."""
from tests import models
from tests.workers.common import tp_mesh


def one_step(pm, name):
    loss = pm(models.batch(name, seed=7))
    loss.backward()
    return loss.item(), {n: g.clone() for n, g in pm.full_grads().items()}


def fp8_tp(rank, world, layouts):
    """{(name, recipe, sp): (loss, grads, fp8 nodes, fp8 nodes the dump lists as collectives)}
    at tp=world, for ``layouts``: {name: [(recipe, sequence_parallel), ...]}."""
    import fxmegatron
    from fxmegatron.io.dump import collective_nodes

    mesh = tp_mesh(world)
    out = {}
    for name, todo in layouts.items():
        for recipe, sp in todo:
            pm = fxmegatron.parallelize(models.build(name), mesh, models.batch(name), sequence_parallel=sp,
                                        precision="fp8", fp8_recipe=recipe)
            n_fp8 = sum(1 for n in pm.graph_module.graph.nodes if n.meta.get("fp8", "").startswith("fp8"))
            n_amax = [k for _, k in collective_nodes(pm.graph_module)].count("fp8_amax")
            out[(name, recipe, sp)] = one_step(pm, name) + (n_fp8, n_amax)
    return out
