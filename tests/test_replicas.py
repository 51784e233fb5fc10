"""Data-parallel replicas (and the tp ranks of a replicated parameter, and the pipeline ranks of
a tied weight) built with different weights are refused by parallelize, naming the parameter and
the ranks: trained on, they would stay different for ever while the dp-averaged loss hides it."""
import hashlib

import torch

from fxmegatron.lower import materialize
from tests.distributed import run_distributed
from tests.workers.replicas import different_weights


def test_ranks_given_different_weights_are_refused():
    per_rank = run_distributed(different_weights, 2)
    assert per_rank[0] == per_rank[1]       # every rank raises the same error: none waits in a collective
    same_seed, dp, tp, pp, full, full_same = per_rank[0]
    assert same_seed is None
    assert dp.startswith("parameter 'wte.weight' differs between the data-parallel replicas: global rank(s) [0] "
                         "hold one value and [1] another"), dp
    assert "torch.manual_seed(S)" in dp
    assert tp.startswith("parameter 'blocks.1.ln2.weight' differs between the tp ranks (it is replicated over tp): "
                         "global rank(s) [0] hold one value and [1] another"), tp
    assert pp.startswith("parameter 'wte.weight' differs between the pipeline ranks holding a copy of this tied "
                         "weight"), pp
    assert full == dp and full_same is None     # fully sharded: the shards differ, the whole pieces must not


def test_a_weight_hashed_in_pieces_tells_any_changed_bit(monkeypatch):
    """Above ``DIGEST_CHUNK`` bytes a weight is hashed in pieces on threads: every piece counts
    (the last, partial one too), as do a signed zero, a NaN's bits and the shape."""
    monkeypatch.setattr(materialize, "DIGEST_CHUNK", 64)
    t = torch.randn(250)            # 1000 bytes: 15 pieces of 64 and one of 40
    d = materialize.weight_digest(t)
    raw = t.numpy().view("uint8")
    assert d.endswith(materialize._bytes_digest(raw)) and not d.endswith(hashlib.blake2b(raw, digest_size=16).hexdigest())
    assert d == materialize.weight_digest(t.clone())
    for at, value in [(0, 1.0), (100, -2.0), (249, 3.0)]:
        u = t.clone()
        u[at] = value
        assert materialize.weight_digest(u) != d, at
    z, nz = torch.zeros(250), torch.zeros(250)
    nz[249] = -0.0
    assert materialize.weight_digest(z) != materialize.weight_digest(nz)
    n1 = torch.full((250,), float("nan"))
    n2 = n1.clone()
    n2.view(torch.int32)[249] ^= 1           # another NaN payload
    assert materialize.weight_digest(n1) != materialize.weight_digest(n2)
    assert materialize.weight_digest(t.view(10, 25)) != d
