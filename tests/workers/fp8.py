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
    quantisations, those the dump lists, sequence gathers in FP8)}
    at tp=world, for ``layouts``: {name: [(recipe, sequence_parallel), ...]}."""
    import fxmegatron
    from fxmegatron.io.dump import collective_nodes
    from fxmegatron.ops.fp8_gather import gather_quantize_operand
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
            n_gather = sum(1 for n in pm.graph_module.graph.nodes if n.target is gather_quantize_operand)
            out[(name, recipe, sp)] = one_step(pm, name) + (n_fp8, len(amax) - n_quant_amax, n_quant, n_quant_amax,
                                                            n_gather)
    return out


def fp8_pp(rank, world, cases, sequence_parallel=False):
    """{(name, recipe, schedule): (loss, this rank's whole gradients, sequence gathers in FP8 in
    its stage)} of one ``train_step`` at pp=2 (tp = world / 2) with 2 microbatches, for
    ``cases``: [(name, recipe, schedule), ...]."""
    import torch

    import fxmegatron
    from tests.workers.common import pp_mesh

    mesh = pp_mesh(world, 2)
    out = {}
    for name, recipe, schedule in cases:
        batch = models.batch(name, seed=7, batch_size=4)
        pm = fxmegatron.parallelize(models.build(name, n_layer=4), mesh, batch, microbatches=2, schedule=schedule,
                                    precision="fp8", fp8_recipe=recipe, sequence_parallel=sequence_parallel)
        loss = pm.train_step(batch)
        from fxmegatron.ops.fp8_gather import gather_quantize_operand
        gathers = sum(1 for m in pm.stages.values() for sub in m.modules() if isinstance(sub, torch.fx.GraphModule)
                      for n in sub.graph.nodes if n.target is gather_quantize_operand)
        out[(name, recipe, schedule)] = (loss.item(), {n: g.clone() for n, g in pm.full_grads().items()}, gathers)
    return out


def fp8_tp_compiled(rank, world, name, recipe):
    """(loss, whole gradients) of one step at tp=world with sequence parallelism and
    ``compile=True``: torch.compile traces the FP8 triton_ops, amax all-reduces included."""
    import fxmegatron

    pm = fxmegatron.parallelize(models.build(name), tp_mesh(world), models.batch(name), sequence_parallel=True,
                                precision="fp8", fp8_recipe=recipe, compile=True)
    return one_step(pm, name)


def tp2_sp_graphs(rank, world, cases):
    """{(name, policy): (gathers in FP8, what each bf16 gather's node says, kinds of collectives,
    FP8 linears reading a gathered input, the x, w and dy amaxes of each FP8 linear by
    ``fp8_report``)} of this rank's graph at tp=world with sequence
    parallelism, for ``cases``: [(name, fp8_policy), ...]."""
    import torch

    import fxmegatron
    from fxmegatron.io.dump import collective_nodes
    from fxmegatron.ops.collectives import all_gather_seq, gather_seq
    from fxmegatron.ops.fp8_gather import fp8_gathered_input, fp8_gathered_whole_input, gather_quantize_operand
    from fxmegatron.ops.fp8_operands import fp8_linear_q

    from tests.test_fp8_pass import model_and_batch

    out = {}
    for name, policy in cases:
        model, batch = model_and_batch(name)
        pm = fxmegatron.parallelize(model, tp_mesh(world), batch, sequence_parallel=True, precision="fp8",
                                    fp8_policy=policy)
        nodes = list(pm.graph_module.graph.nodes)
        n_fp8 = sum(1 for n in nodes if n.target is gather_quantize_operand)
        bf16 = [n.meta.get("fp8", "") for n in nodes if n.target in (gather_seq, all_gather_seq)]
        kinds = sorted({k for _, k in collective_nodes(pm.graph_module)})

        proxies = (fp8_gathered_input, fp8_gathered_whole_input)

        def gathered(n):
            return n.target in proxies or (n.target is torch.ops.aten.reshape.default and n.args[0].target in proxies)
        readers = sum(1 for n in nodes if n.target is fp8_linear_q and gathered(n.args[0]))
        x_amax = {(r["module"], what): r[what]["amax"] for r in pm.fp8_report(batch) for what in ("x", "w", "dy")}
        out[(name, policy)] = (n_fp8, bf16, kinds, readers, x_amax)
    return out


def family_step(pm, name):
    """(loss, whole gradients) of one step of an HF family's model on its seed-7 batch."""
    from tests.test_fp8_pass import model_and_batch
    loss = pm(model_and_batch(name, seed=7)[1])
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    loss.backward()
    return loss.item(), {n: g.clone() for n, g in pm.full_grads().items()}


def fp8_sp_families(rank, world, cases):
    """{(name, recipe): (loss, whole gradients, gathers in FP8)} of one step at tp=world with
    sequence parallelism and FP8 linears, for ``cases``: [(HF family, recipe), ...]."""
    import fxmegatron
    from fxmegatron.ops.fp8_gather import gather_quantize_operand
    from tests.test_fp8_pass import model_and_batch

    from fxmegatron.errors import ShardingError

    out = {}
    for name, recipe in cases:
        model, batch = model_and_batch(name)
        try:
            pm = fxmegatron.parallelize(model, tp_mesh(world), batch, sequence_parallel=True, precision="fp8",
                                        fp8_recipe=recipe)
        except ShardingError as exc:        # the layout itself is refused (test_family_matrix says why)
            out[(name, recipe)] = ("refused", str(exc))
            continue
        n_gather = sum(1 for n in pm.graph_module.graph.nodes if n.target is gather_quantize_operand)
        out[(name, recipe)] = family_step(pm, name) + (n_gather,)
    return out
