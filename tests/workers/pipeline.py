"""Pipeline parallelism: schedules against the unmodified model, a failing rank, what a chunk sends."""
import copy

from tests import models
from tests.workers.common import pp_mesh, train_side_by_side


def pipeline_parity(rank, world, pp, names, configs, n_layer=8, batch_size=8, steps=2, extra=None):
    """For each model and (schedule, virtual_stages, microbatches): losses of ``steps`` AdamW steps
    and first-step gradients (this rank's parameters) of fxmegatron at (pp, tp=world/pp), next to
    the unmodified model's."""
    import fxmegatron

    mesh = pp_mesh(world, pp)
    out = {}
    for name in names:
        model = models.build(name, n_layer=n_layer)
        for sched, v, m in configs:
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, models.batch(name, batch_size=batch_size),
                                        microbatches=m, virtual_stages=v, schedule=sched, **(extra or {}))
            out[(name, sched, v, m)] = train_side_by_side(pm, copy.deepcopy(model), name, steps, batch_size)
    return out


def pipeline_failure(rank, world, fail_rank, microbatches=4):
    """Pipeline rank ``fail_rank`` raises in its third chunk call; every rank returns
    (exception type, message, seconds from the start of train_step to the exception)."""
    import time

    import fxmegatron

    mesh = pp_mesh(world, world)
    name = "gpt"
    pm = fxmegatron.parallelize(models.build(name, n_layer=4), mesh, models.batch(name, batch_size=8),
                                microbatches=microbatches)
    runner = pm._runner
    if pm.pp_rank == fail_rank:
        (c, chunk), = runner.chunks.items()
        calls = []

        def sabotaged(*args):
            calls.append(1)
            if len(calls) == 3:
                raise ValueError(f"injected failure in chunk {c}")
            return chunk(*args)

        runner.chunks[c] = sabotaged
    t0 = time.time()
    try:
        pm.train_step(models.batch(name, batch_size=8))
        return ("none", "", time.time() - t0)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.time() - t0)


def pipeline_boundaries(rank, world, name="gpt", n_layer=4):
    """Number of tensors each chunk sends on, at pp2 x tp2, interleaved, sequence parallel."""
    import fxmegatron

    pm = fxmegatron.parallelize(models.build(name, n_layer=n_layer), pp_mesh(world, 2),
                                models.batch(name, batch_size=4), sequence_parallel=True, microbatches=2,
                                virtual_stages=2, schedule="interleaved")
    return [len(c.boundary_out) for c in pm.program.pipeline.chunks]
