"""Context parallelism (cp, with tp + sp and pp): training next to the unmodified model on
batches with ignored labels, and what a rank's graph holds."""
import copy

import torch

from tests import families, models
from tests.workers.common import side_by_side


def masked_batch(name, seed, batch_size=2):
    """The test batch of ``name`` with some labels ignored (-100): the loss is a mean over
    fewer tokens than the batch holds, and over a different number on each cp rank. HF
    families: right-padded rows as well (``families.make_batch``)."""
    if name in families.FAMILIES:
        return families.make_batch(families.FAMILIES[name], seed, batch_size)
    ids, labels = models.batch(name, seed=seed, batch_size=batch_size)
    g = torch.Generator().manual_seed(1000 + seed)
    labels = labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.3, -100)
    labels[0, : labels.shape[1] // 2] = -100          # a whole chunk ignored on some rank
    return (ids, labels)


def build(name, n_layer=2):
    if name in families.FAMILIES:
        return families.FAMILIES[name].build(n_layer)
    return models.build(name, n_layer=n_layer)


def cp_parity(rank, world, dims, names, variant="ring", steps=3, batch_size=2, kwargs=None):
    """Three AdamW steps on different batches at the mesh ``dims`` ({"cp": 2, "tp": 2, ...}),
    next to the unmodified model; the first step's gradient errors."""
    import fxmegatron
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    out = {}
    for name in names:
        model = build(name)
        pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, masked_batch(name, 0, batch_size),
                                    cp_attention=variant, **(kwargs or {}))
        res = side_by_side(pm, copy.deepcopy(model), lambda i: masked_batch(name, i, batch_size), steps,
                           step=lambda pm, b: pm.train_step(b), local_only=True)
        res["saved"] = (_saved(pm, masked_batch(name, 9, batch_size)),
                        _saved(fxmegatron.parallelize(copy.deepcopy(model), None, masked_batch(name, 0, batch_size)),
                               masked_batch(name, 9, batch_size)))
        res["ops"] = sorted({getattr(n.target, "__name__", str(n.target)) for top in _graphs(pm)
                             for gm in top.modules() if isinstance(gm, torch.fx.GraphModule)
                             for n in gm.graph.nodes if n.op == "call_function"})
        if rank == 0 and name == names[0]:
            import tempfile
            with tempfile.TemporaryDirectory() as d:
                pm.dump(d)
                res["collectives"] = open(f"{d}/rank0/collectives.txt").read() if pm.program.pipeline is None \
                    else ""
                res["placements"] = open(f"{d}/rank0/placements.txt").read() if pm.program.pipeline is None \
                    else ""
        out[name] = res
    return out


def _saved(pm, b):
    """Bytes autograd keeps for backward in one forward (``fxmegatron.runtime.memory``)."""
    from fxmegatron.runtime.memory import saved_bytes
    if pm.program.pipeline is not None or pm.dp_size > 1:
        return None
    with saved_bytes(exclude=list(pm.parameters())) as got:
        pm(b)
    return got["bytes"]


def _graphs(pm):
    if pm.program.pipeline is None:
        return [pm.graph_module]
    return list(pm.program.pipeline.stage.modules.values())


def cp_families(rank, world, names, steps=2):
    """Each family at cp=world: (worst loss error, worst gradient error) over ``steps`` AdamW
    steps next to the unmodified model, or the refusal's message."""
    import fxmegatron
    from torch.distributed.device_mesh import init_device_mesh

    from fxmegatron.errors import ShardingError

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = {}
    for name in names:
        model = build(name)
        try:
            pm = fxmegatron.parallelize(copy.deepcopy(model), mesh, masked_batch(name, 0))
        except ShardingError as exc:
            out[name] = str(exc)
            continue
        r = side_by_side(pm, copy.deepcopy(model), lambda i: masked_batch(name, i), steps,
                         step=lambda pm, b: pm.train_step(b), local_only=True)
        out[name] = (max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["losses_ref"])),
                     max(r["grad_err"].values()))
    return out
