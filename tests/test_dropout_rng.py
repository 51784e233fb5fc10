"""Counter-based dropout (fxmegatron.ops.dropout): masks keyed by global element index.

With dropout > 0: recompute on gives bitwise the losses and gradients of recompute off
(world 2 and 4), masks differ across tp ranks inside tp regions and agree outside, and
results do not depend on tp or sequence parallelism (they equal the one-process run).
"""
import pytest
import torch

import fxmegatron
from fxmegatron.placement import Shard, take_shard
from fxmegatron.ops.dropout import DropoutRng, keep_mask, local_layout
from tests import models
from tests.distributed import run_distributed
from tests.workers import dropout_runs, dropout_single

MODELS = ("gpt", "gpt2", "llama")


def test_shard_masks_are_pieces_of_the_unsplit_mask():
    rng = DropoutRng(seed=3)
    key = rng.next_key("cpu")
    shape = (2, 8, 16, 24)
    full = keep_mask(key, 4, 0.3, shape, shape)
    for plc in (Shard(1), Shard(3, blocks=(8, 8, 8)), Shard(2)):
        world = 4 if plc.blocks is None else 2
        pieces = []
        for r in range(world):
            d, slices = local_layout(shape, plc, r, world)
            local = [n // world if i == plc.dim else n for i, n in enumerate(shape)]
            piece = keep_mask(key, 4, 0.3, local, shape, d, slices)
            assert torch.equal(piece, take_shard(full, plc, r, world)), plc
            pieces.append(piece)
        # inside a tp region every rank draws a different mask
        assert not torch.equal(pieces[0], pieces[1])


def test_mask_statistics_and_keys():
    rng = DropoutRng(seed=0)
    k0, k1 = rng.next_key("cpu"), rng.next_key("cpu")
    shape = (64, 1024)
    m0 = keep_mask(k0, 0, 0.25, shape, shape)
    assert abs(m0.float().mean().item() - 0.75) < 0.01
    assert torch.equal(m0, keep_mask(k0.clone(), 0, 0.25, shape, shape))      # same key: same mask
    assert (m0 != keep_mask(k1, 0, 0.25, shape, shape)).float().mean() > 0.3  # next step: new mask
    assert (m0 != keep_mask(k0, 1, 0.25, shape, shape)).float().mean() > 0.3  # next site: new mask
    assert not torch.equal(m0, keep_mask(DropoutRng(seed=1).next_key("cpu"), 0, 0.25, shape, shape))


def test_dropout_changes_per_step_and_is_active():
    model = models.build("gpt", dropout=0.5)
    b = models.batch("gpt")
    pm = fxmegatron.parallelize(model, None, b)
    l1, l2 = pm(b).item(), pm(b).item()
    assert l1 != l2                                   # a new mask each forward
    assert pm.graph_module.fxm_rng.step == 2           # one key per forward call


def test_unsupported_random_op_is_named():
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return (self.lin(x) + torch.randn_like(x)).sum()

    with pytest.raises(fxmegatron.FxMegatronError, match="randn_like.*key by element index"):
        fxmegatron.parallelize(Noisy(), None, (torch.randn(2, 8),))


LAYOUTS = {2: [(False, "none"), (False, "selective"), (False, "full"), (True, "none"), (True, "full")],
           4: [(False, "none"), (True, "none"), (True, "selective"), (True, "full")]}


@pytest.fixture(scope="module")
def singles():
    """The one-process runs every layout must equal, once here rather than on every rank."""
    return dropout_single(MODELS)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def runs(request, singles):
    world = request.param
    return world, singles, run_distributed(dropout_runs, world, MODELS, LAYOUTS[world], 2, 0.1, None, False)


@pytest.mark.parametrize("name", MODELS)
def test_recompute_is_bitwise_and_results_do_not_depend_on_tp(runs, name):
    world, singles, per_rank = runs
    single_losses, single_grads = singles[name]
    for rank, res in enumerate(per_rank):
        r = res[name]
        for sp in (False, True):
            base = r.get((sp, "none"))
            if base is None:
                continue
            for rc in ("selective", "full"):
                if (sp, rc) not in r:
                    continue
                losses, grads = r[(sp, rc)]
                assert all(torch.equal(a, b) for a, b in zip(losses, base[0])), (world, sp, rc, losses, base[0])
                for n in base[1]:
                    assert torch.equal(grads[n], base[1][n]), (world, sp, rc, n)
        for (sp, rc), (losses, grads) in ((k, v) for k, v in r.items() if k != "single"):
            for a, b in zip(losses, single_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (world, sp, rc, losses, single_losses)
            scale = 0.01 * max(g.abs().max().item() for g in single_grads.values())
            for n, g in single_grads.items():
                err = ((grads[n] - g).abs().max() / max(g.abs().max().item(), scale)).item()
                assert err <= 1e-4, (world, sp, rc, n, err)
