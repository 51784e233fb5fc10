"""A trainer's model source through ``parallelize``, one AdamW step and a checkpoint, for the
export tests: run on gloo processes, or in the test's own process (``layout`` None)."""
import torch

from tests.families import FAMILIES, make_batch
from tests.workers.common import mesh_3d

GPT_OPTIONS = {"vocab_size": 128, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 64}


def gpt_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, GPT_OPTIONS["vocab_size"], (4, GPT_OPTIONS["block_size"]), generator=g)
                 for _ in range(2))


def batch_of(family, seed):
    return gpt_batch(seed) if family is None else make_batch(FAMILIES[family], seed, batch_size=4)


def load_step_save(rank, world, layout, kind, path, options, ckpt, family=None, overrides=None):
    """``load_model(kind, path, options)`` through ``parallelize`` at ``layout`` (dp, pp, tp; None:
    one process, no mesh). For an HF ``family`` (the model saved at ``path``, built with
    ``overrides``): whether every local parameter is the slice ``parallelize`` cuts from that model
    in memory (``take_shard`` of its tensor). Then one AdamW step and a checkpoint in ``ckpt``
    with the model's description; rank 0 returns the whole state and the parallel loss on a
    fresh batch."""
    import fxmegatron
    from fxmegatron.io import checkpoint
    from fxmegatron.placement import R, take_shard
    from fxmegatron.train.models import load_model

    mesh = mesh_3d(*layout) if layout else None
    pp = layout[1] if layout else 1
    src = load_model(kind, path, options, torch.float32)
    pm = fxmegatron.parallelize(src.model, mesh, batch_of(family, 0), state_dict=src.state_dict,
                                microbatches=2 if pp > 1 else 1)
    out = {"same_local": None, "split": sorted(n for n, _ in pm.named_parameters() if pm.placement(n) != R)}
    if family is not None:
        ref = dict(FAMILIES[family].build(**(overrides or {})).named_parameters())
        out["same_local"] = all(torch.equal(p, take_shard(ref[n], pm.placement(n), pm.tp_rank, pm.tp_size))
                                for n, p in pm.named_parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.train_step(batch_of(family, 1))
    opt.step()
    opt.zero_grad()
    checkpoint.save(pm, opt, ckpt, extra={"model": src.describe})
    full = pm.full_state_dict()
    batch = batch_of(family, 2)
    loss = pm.train_step(batch).item()
    if rank == 0:
        out.update(full={k: v.clone() for k, v in full.items()}, loss=loss, batch=batch,
                   pp_ranks=pm.pp_size, params=[n for n, _ in pm.named_parameters()])
    return out
