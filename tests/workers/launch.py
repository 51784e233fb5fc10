"""fxmegatron.launch's batches through parallelize() in-process (the reference for a compiled folder)."""
import torch

from tests.workers.common import mesh_3d


def inprocess_lm_losses(rank, world, layout, steps, microbatches=2, lr=1e-3):
    """The factory model through parallelize() in-process, on fxmegatron.launch's batches."""
    import os
    import sys

    import fxmegatron
    from fxmegatron.launch import lm_batch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "factories"))
    import gpt_small

    dp, pp, tp = layout
    model, _ = gpt_small.build()
    rows = gpt_small.ROWS * dp
    pm = fxmegatron.parallelize(model, mesh_3d(dp, pp, tp), lm_batch(None, 0, rows, gpt_small.SEQ),
                                microbatches=microbatches)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        losses.append(pm.train_step(lm_batch(None, step, rows, gpt_small.SEQ)).item())
        opt.step()
        opt.zero_grad()
    return losses


def folder_against_parallelize(rank, world, folder, microbatches=2):
    """One process, pp1: the factory model through parallelize (chunked, as ``fxmegatron compile``
    builds it), written to ``folder`` and loaded back; a batch whose first microbatch has most
    labels ignored. (loss, gradients) of each, and whether the folder holds a counter."""
    import os
    import sys

    import fxmegatron
    from fxmegatron.io.stage_folder import load_folder, write_folder

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "factories"))
    import gpt_small

    model, batch = gpt_small.build()
    mesh = mesh_3d(1, 1, 1)
    pm = fxmegatron.parallelize(model, mesh, batch, microbatches=microbatches, _chunked=True)
    write_folder(pm, folder)
    loaded = load_folder(folder, mesh)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (gpt_small.ROWS, gpt_small.SEQ), generator=g)
    labels = torch.randint(0, 256, (gpt_small.ROWS, gpt_small.SEQ), generator=g)
    labels[: gpt_small.ROWS // microbatches, 2:] = -100     # microbatch 0 counts 2 labels a row
    out = []
    for m in (pm, loaded):
        loss = m.train_step((tokens, labels)).item()
        out.append((loss, {n: p.grad.clone() for n, p in m.named_parameters()}))
    with open(os.path.join(folder, "pp0-tp0", "stage.py")) as f:
        has_counter = "class CountTokens" in f.read()
    return out, has_counter
