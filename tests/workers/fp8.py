"""FP8 linears at tp=world (``parallelize(precision="fp8")``): loss and whole gradients of one
step, to compare with the same FP8 program at world size 1."""
from tests import models
from tests.workers.common import tp_mesh


def one_step(pm, name):
    loss = pm(models.batch(name, seed=7))
    loss.backward()
    return loss.item(), {n: g.clone() for n, g in pm.full_grads().items()}


def fp8_tp(rank, world, layouts):
    """{(name, recipe, sp): (loss, grads, FP8 linears, those the dump lists as collectives, FP8
    quantisations, those the dump lists)}
    at tp=world, for ``layouts``: {name: [(recipe, sequence_parallel), ...]}."""
    import fxmegatron
    from fxmegatron.io.dump import collective_nodes
    from fxmegatron.ops.fp8_operands import quantize_operand

    mesh = tp_mesh(world)
    out = {}
    for name, todo in layouts.items():
        for recipe, sp in todo:
            pm = fxmegatron.parallelize(models.build(name), mesh, models.batch(name), sequence_parallel=sp,
                                        precision="fp8", fp8_recipe=recipe)
            n_fp8 = sum(1 for n in pm.graph_module.graph.nodes if n.meta.get("fp8", "").startswith("fp8"))
            amax = [n for n, k in collective_nodes(pm.graph_module) if k == "fp8_amax"]
            n_quant = sum(1 for n in pm.graph_module.graph.nodes if n.target is quantize_operand)
            n_quant_amax = sum(1 for n in amax if n.target is quantize_operand)
            out[(name, recipe, sp)] = one_step(pm, name) + (n_fp8, len(amax) - n_quant_amax, n_quant, n_quant_amax)
    return out


def fp8_pp(rank, world, cases):
    """{(name, recipe, schedule): (loss, this rank's whole gradients)} of one ``train_step`` at
    pp=2 (tp = world / 2) with 2 microbatches, for ``cases``: [(name, recipe, schedule), ...]."""
    import fxmegatron
    from tests.workers.common import pp_mesh

    mesh = pp_mesh(world, 2)
    out = {}
    for name, recipe, schedule in cases:
        batch = models.batch(name, seed=7, batch_size=4)
        pm = fxmegatron.parallelize(models.build(name, n_layer=4), mesh, batch, microbatches=2, schedule=schedule,
                                    precision="fp8", fp8_recipe=recipe)
        loss = pm.train_step(batch)
        out[(name, recipe, schedule)] = (loss.item(), {n: g.clone() for n, g in pm.full_grads().items()})
    return out


def fp8_tp_compiled(rank, world, name, recipe):
    """(loss, whole gradients) of one step at tp=world with sequence parallelism and
    ``compile=True``: torch.compile traces the FP8 triton_ops, amax all-reduces included."""
    import fxmegatron

    pm = fxmegatron.parallelize(models.build(name), tp_mesh(world), models.batch(name), sequence_parallel=True,
                                precision="fp8", fp8_recipe=recipe, compile=True)
    return one_step(pm, name)
