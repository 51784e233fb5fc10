"""Data-parallel replicas (and the tp ranks of a replicated parameter, and the pipeline ranks of
a tied weight) built with different weights are refused by parallelize, naming the parameter and
the ranks: trained on, they would stay different for ever while the dp-averaged loss hides it."""
import hashlib

import torch

from fxmegatron.lower import materialize
from tests.distributed import run_distributed
from tests.workers.replicas import different_weights, parted_during_training


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


def test_copies_that_part_during_training_are_named():
    """``pm.check_replicas`` (the trainer runs it before each checkpoint): after a step nothing is
    reported, shards and experts included; a copy nudged on one rank is named with the ranks."""
    per_rank = run_distributed(parted_during_training, 2)
    assert per_rank[0] == per_rank[1]
    (tp_first, tp_second), (full_first, _), (ep_first, ep_second) = per_rank[0]
    assert tp_first is None and full_first is None and ep_first is None, per_rank[0]
    assert tp_second.startswith("parameter 'blocks.1.ln2.weight' differs between the tp ranks (it is replicated over "
                                "tp) after step 1: global rank(s) [0] hold one value and [1] another"), tp_second
    assert "no longer train one model" in tp_second
    assert ep_second.startswith("parameter 'model.layers.0.mlp.gate.weight' differs between the data-parallel "
                                "replicas after step 1"), ep_second


def test_a_fingerprint_tells_one_changed_element_anywhere():
    from fxmegatron.runtime import replica_check
    t = torch.randn(1000).to(torch.bfloat16)
    f = replica_check.fingerprint(t)
    assert f == replica_check.fingerprint(t.clone())
    for at in (0, 499, 999):
        u = t.clone()
        u[at] = -u[at] if u[at] != 0 else 1.0
        assert replica_check.fingerprint(u) != f, at
    swapped = t.clone()
    swapped[[3, 7]] = t[[7, 3]]
    assert t[3] == t[7] or replica_check.fingerprint(swapped) != f     # order counts
    assert replica_check.fingerprint(t.view(10, 100)) != f
