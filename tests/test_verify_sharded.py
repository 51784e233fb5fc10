"""Translation validation under ``dp_shard="full"`` (ZeRO-3): every dp × cp × tp rank runs at
once on simulated ranks, each holding its shard of every parameter, the ``unshard`` nodes
gathering and reduce-scattering over a simulated dp × cp group; the gradients put together
from the shards match the model's. A planted wrong shard and a doubled reduce-scatter are
named. Under "optimizer" and "gradients" the runtime's own bucket reduction runs on the
simulated ranks, and a dropped piece is named."""
import importlib

import pytest

import fxmegatron
from fxmegatron.errors import VerificationError
from tests.families import FAMILIES, make_batch

dp_gather = importlib.import_module("fxmegatron.ops.dp_gather")
materialize = importlib.import_module("fxmegatron.lower.materialize")


def _case(name, n_layer=2):
    fam = FAMILIES[name]
    return fam.build(n_layer=n_layer), make_batch(fam, seed=0, batch_size=8)


@pytest.mark.parametrize("name,layout,label", [
    ("gpt2", dict(tp=1, dp=2), "tp=1 dp=2 dp_shard=full"),                  # tied embedding and head
    ("llama", dict(tp=2, dp=2, microbatches=2, sequence_parallel=True), "tp=2 m=2 dp=2 sp dp_shard=full"),
    ("mixtral", dict(tp=2, dp=2, sequence_parallel=True), "tp=2 dp=2 sp dp_shard=full"),     # MoE
    ("llama", dict(tp=1, dp=2, cp=2, recompute="full"), "tp=1 dp=2 cp=2 recompute=full dp_shard=full"),  # dp × cp
    # interleaved pipeline: the tied embedding and head gathered in their own chunks on two stages
    ("gpt2", dict(tp=1, dp=2, pp=2, virtual_stages=2, microbatches=4), "tp=1 pp=2 v=2 m=4 dp=2 dp_shard=full"),
    ("llama", dict(tp=2, dp=2, pp=2, microbatches=2, recompute="full", sequence_parallel=True),
     "tp=2 pp=2 m=2 dp=2 sp recompute=full dp_shard=full"),                # 8 simulated ranks
])
def test_fully_sharded_layouts_are_exact(name, layout, label):
    model, batch = _case(name, 2 * layout.get("virtual_stages", 1) if layout.get("pp", 1) > 1 else 2)
    report = fxmegatron.verify(model, batch, dp_shard="full", **layout)
    assert report.layout == label, str(report)
    assert report.max_grad_err < 1e-4 and abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref)


def test_a_wrong_shard_is_named(monkeypatch):
    """The planted fault: every rank materialises the next rank's shard of each parameter, so
    the gathered weights come out rotated and the first node reading one differs."""
    take = materialize.take_dp_shard
    monkeypatch.setattr(materialize, "take_dp_shard", lambda t, world, rank: take(t, world, (rank + 1) % world))
    model, batch = _case("llama")
    with pytest.raises(VerificationError, match=r"dp_shard=full.*first divergent node .*model\.") as err:
        fxmegatron.verify(model, batch, tp=1, dp=2, dp_shard="full")
    print(err.value)


def test_a_bucket_reduce_scattered_twice_is_named(monkeypatch):
    """The planted fault: each shard's gradient reduce-scattered twice (doubled): every forward
    value agrees and a parameter's gradient is named."""
    once = dp_gather.reduce_scatter
    monkeypatch.setattr(dp_gather, "reduce_scatter", lambda flat, *a: once(flat, *a) + once(flat, *a))
    model, batch = _case("gpt2")
    with pytest.raises(VerificationError, match=r"every forward value agrees, but parameter \S+ .*gradient differs "
                                                r"by 1\.0") as err:
        fxmegatron.verify(model, batch, tp=1, dp=2, dp_shard="full")
    print(err.value)


@pytest.mark.parametrize("name,mode,layout,label", [
    ("gpt2", "optimizer", dict(tp=1, dp=2, cp=2), "tp=1 dp=2 cp=2 dp_shard=optimizer"),
    ("gpt2", "gradients", dict(tp=2, dp=2, pp=2, virtual_stages=2, microbatches=4),
     "tp=2 pp=2 v=2 m=4 dp=2 dp_shard=gradients"),
])
def test_runtime_modes_reduce_their_buckets_on_simulated_ranks(name, mode, layout, label):
    """"optimizer" and "gradients": the runtime's GradSync on each simulated rank, over a
    simulated dp × cp group, its pieces gathered back into whole gradients."""
    model, batch = _case(name, 2 * layout.get("virtual_stages", 1))
    report = fxmegatron.verify(model, batch, dp_shard=mode, **layout)
    assert report.layout == label and report.max_grad_err < 1e-4, str(report)


def test_a_dropped_microbatch_piece_is_named(monkeypatch):
    """The planted fault: under "gradients" each bucket's first reduced piece is dropped, not
    summed, when the next microbatch's arrives."""
    from fxmegatron.runtime.data_parallel import GradSync
    retire = GradSync._retire

    def dropping(self):
        b = self._in_flight[0][0]
        had = self._sums[b] is not None
        retire(self)
        if not had:
            self._sums[b].zero_()
    monkeypatch.setattr(GradSync, "_retire", dropping)
    model, batch = _case("gpt2")
    with pytest.raises(VerificationError, match=r"dp_shard=gradients.*every forward value agrees, but parameter "
                                                r"\S+ .*gradient differs") as err:
        fxmegatron.verify(model, batch, tp=1, dp=2, microbatches=2, dp_shard="gradients")
    print(err.value)


def test_cli_takes_the_mode(capsys):
    from fxmegatron.cli import main as cli_main
    rc = cli_main(["verify", "--factory", "tests/factories/gpt_small.py:build", "--tp", "1", "--dp", "2",
                   "--dp-shard", "full"])
    out = capsys.readouterr().out
    assert rc == 0 and "verify tp=1 dp=2 dp_shard=full: exact" in out, out


@pytest.mark.parametrize("name,mode,layout,label", [
    ("gpt2", "full", dict(tp=1, dp=4), "tp=1 dp=4 dp_shard=full dp_replicate=2"),
    ("llama", "gradients", dict(tp=1, dp=4, microbatches=2), "tp=1 m=2 dp=4 dp_shard=gradients dp_replicate=2"),
    ("gpt2", "optimizer", dict(tp=1, dp=2, cp=2), "tp=1 dp=2 cp=2 dp_shard=optimizer dp_replicate=2"),
])
def test_hybrid_sharding_is_simulated(name, mode, layout, label):
    """dp_replicate: each replica group shards over its own simulated group, the pieces summed
    over a simulated group of the replicas."""
    model, batch = _case(name)
    report = fxmegatron.verify(model, batch, dp_shard=mode, dp_replicate=2, **layout)
    assert report.layout == label and report.max_grad_err < 1e-4, str(report)


@pytest.mark.parametrize("mode", ["full", "optimizer"])
def test_hybrid_sharding_without_the_sum_over_replicas_is_named(monkeypatch, mode):
    """The planted fault: the all-reduce over the replicas left out (the unshard backward's under
    "full", GradSync's under "optimizer"): each replica's gradient misses the others' batches."""
    from fxmegatron.runtime.data_parallel import GradSync
    monkeypatch.setattr(dp_gather, "all_reduce", lambda piece, op, group: piece)
    init = GradSync.__init__

    def without_replicas(self, *a, **kw):
        init(self, *a, **kw)
        self.replicas = None
    monkeypatch.setattr(GradSync, "__init__", without_replicas)
    model, batch = _case("gpt2")
    with pytest.raises(VerificationError, match=rf"dp_shard={mode} dp_replicate=2.*gradient differs") as err:
        fxmegatron.verify(model, batch, tp=1, dp=4, dp_shard=mode, dp_replicate=2)
    print(err.value)


def test_a_simulated_collective_hands_out_copies():
    """A rank may write over its tensor as soon as its all-reduce returns (GradSync does, in
    place) while another rank still sums the slots: each slot holds a copy. Without it the
    hybrid-sharded "gradients" runs above differed by 0.2–0.6 on some families."""
    import threading

    import torch

    from fxmegatron.ops.groups import SimulatedComm, SimulatedGroup
    g = SimulatedGroup(2, timeout=30)
    xs = [torch.full((4,), float(r + 1)) for r in range(2)]
    outs = [None, None]

    def rank(r):
        comm = SimulatedComm(g, r)
        outs[r] = comm.all_reduce(xs[r])
        xs[r].fill_(100.0)          # as GradSync's in-place all-reduce writes over its tensor
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs), outs
    x = torch.ones(3)
    slots = SimulatedGroup(1).exchange(0, x)
    assert slots[0] is not x and slots[0].data_ptr() != x.data_ptr()
