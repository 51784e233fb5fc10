"""Workers of tests/test_batch_term.py: small models whose loss adds a term to the cross-entropy,
at dp on gloo, next to the unmodified model."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.workers.sharded_dp import _mesh

TERMS = {
    # a router-like z-loss: the mean over the tokens of a per-token value
    "z_loss": lambda m, x, y: F.cross_entropy(x, y) + 1e-2 * torch.logsumexp(x, -1).pow(2).mean(),
    # a regulariser of the weights alone: the same on every replica
    "weights": lambda m, x, y: F.cross_entropy(x, y) + 1e-2 * m.head.weight.pow(2).sum(),
    # the largest logit of the batch: not a sum over its tokens (refused)
    "max": lambda m, x, y: F.cross_entropy(x, y) + 1e-2 * x.amax(),
}


class Head(nn.Module):
    def __init__(self, term):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.term = nn.Embedding(16, 8), nn.Linear(8, 16), term

    def forward(self, ids, labels):
        return TERMS[self.term](self, self.head(self.emb(ids)).flatten(0, 1), labels.flatten())


def head_batch(seed, rows=4, seq=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (rows, seq), generator=g)
    labels = torch.randint(0, 16, (rows, seq), generator=g)
    labels[seed % rows, : 2 + seed % 3] = -100      # a different run of masked labels each batch
    return ids, labels


def head_parity(rank, world, term, steps=3):
    """``steps`` SGD steps of ``Head(term)`` at dp ``world`` on different batches, next to the
    unmodified model: the losses and, per step, the largest whole-gradient error over the
    reference's largest; or the LossError's message."""
    import fxmegatron
    from fxmegatron.errors import LossError
    model = Head(term)
    ref = copy.deepcopy(model)
    try:
        pm = fxmegatron.parallelize(copy.deepcopy(model), _mesh({"dp": world}), head_batch(0))
    except LossError as exc:
        return {"refused": str(exc)}
    opt, opt_ref = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, losses_ref, errs = [], [], []
    for step in range(steps):
        b = head_batch(10 + step)
        loss_ref = ref(*b)
        loss_ref.backward()
        losses_ref.append(loss_ref.item())
        losses.append(pm.train_step(b).item())
        grads = pm.full_grads()
        errs.append(max(((grads[n] - w.grad).abs().max() / w.grad.abs().max()).item()
                        for n, w in ref.named_parameters()))
        opt.step(), opt_ref.step()
        pm.zero_grad(), opt_ref.zero_grad()
    return {"losses": losses, "losses_ref": losses_ref, "errs": errs}
