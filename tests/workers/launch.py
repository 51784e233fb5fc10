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
