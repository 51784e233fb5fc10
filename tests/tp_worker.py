import copy, torch
from tests import models
def work(rank, world, name):
    import fxmegatron
    from torch.distributed.device_mesh import init_device_mesh
    m = models.build(name); b = models.batch(name)
    ref = copy.deepcopy(m)
    lref = models.call(ref, b); lref.backward()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = fxmegatron.parallelize(m, mesh, b)
    l = pm(b); l.backward()
    g = pm.full_grads()
    errs = {}
    for n, p in ref.named_parameters():
        if n in g:
            errs[n] = ((g[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
    worst = max(errs.items(), key=lambda kv: kv[1])
    pm.dump(f"/tmp/dump_{name}_{world}")
    return lref.item(), l.item(), worst, len(g), len(dict(ref.named_parameters()))

