"""Ranks that must hold the same weights but were given different ones (tests/test_replicas.py)."""
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests import models


def _gpt(seed):
    from gpt import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=models.VOCAB, block_size=models.SEQ, n_layer=2, n_head=2, n_embd=16))


def different_weights(rank, world):
    """parallelize's error (None: it returned) for each case, in order: dp2 replicas built with
    the same seed, with seeds 0 and 1; tp2 with a replicated norm weight changed on rank 1;
    pp2 with seeds 0 and 1 (the tied embedding's two copies differ); dp2 with dp_shard="full" and
    seeds 0 and 1, then 0 and 0 (each rank keeps a shard: the digests are of the whole pieces)."""
    import fxmegatron
    from fxmegatron.errors import ReplicaError

    batch = models.batch("gpt", batch_size=4)
    cases = [("dp", 0, None, {}), ("dp", rank, None, {}), ("tp", 0, "blocks.1.ln2.weight", {}),
             ("pp", rank, None, {"microbatches": 2}), ("dp", rank, None, {"dp_shard": "full"}),
             ("dp", 0, None, {"dp_shard": "full"})]
    out = []
    for dim, seed, bump, kw in cases:
        model = _gpt(seed)
        if bump and rank == 1:
            with torch.no_grad():
                model.get_parameter(bump).add_(1e-3)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(dim,))
        try:
            fxmegatron.parallelize(model, mesh, batch, **kw)
            out.append(None)
        except ReplicaError as exc:
            out.append(str(exc))
    return out


def parted_during_training(rank, world):
    """``pm.check_replicas`` after a step, then after rank 1's copy of a parameter is nudged: for
    tp2 (a norm weight replicated over tp), dp2 with ``dp_shard="full"`` (shards differ by design:
    nothing to report) and dp2 × ep2 on a Mixtral (experts differ by design; the router is a
    replica). Each case: (the first check's error or None, the second's)."""
    import fxmegatron
    from fxmegatron.errors import ReplicaError
    from tests.families import FAMILIES, make_batch

    def check(pm):
        try:
            pm.check_replicas(after="after step 1")
            return None
        except ReplicaError as exc:
            return str(exc)

    out = []
    cases = [("tp", "gpt", {}, "blocks.1.ln2.weight"), ("dp", "gpt", {"dp_shard": "full"}, None),
             ("dp", "mixtral", {"ep": 2}, "model.layers.0.mlp.gate.weight")]
    for dim, name, kw, bump in cases:
        if name == "gpt":
            model, batch = _gpt(0), models.batch("gpt", batch_size=4)
        else:
            torch.manual_seed(0)
            model, batch = FAMILIES[name].build(), make_batch(FAMILIES[name], 0, batch_size=4)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(dim,))
        pm = fxmegatron.parallelize(model, mesh, batch, **kw)
        opt = pm.adamw(lr=1e-2)
        pm.train_step(batch)
        opt.step()
        first = check(pm)
        second = None
        if bump is not None:
            if rank == 1:
                with torch.no_grad():
                    dict(pm.named_parameters())[bump].add_(1e-3)
            second = check(pm)
        out.append((first, second))
    return out
