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
