"""``fxmegatron train`` with ``layout.dp_shard = "optimizer"`` (fp32, gloo, CPU): the losses of the
unsharded dp2 run (to rounding: the gradient norm sums its squares in another order), its
checkpoints written from every rank's share, and loaded bit for bit by the same layout and, to
rounding, by one process without sharding and by dp_shard = "gradients" over two microbatches."""
import pytest

from fxmegatron.train.checkpoints import step_dir
from tests.trainer_runs import TINY, rows, train, write_config

pytestmark = pytest.mark.slow

STEPS = 6


def config(tmp_path, name, layout, resume="auto"):
    return write_config(tmp_path / f"{name}.toml", {
        "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 3, "log_every": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 8},
        "layout": layout,
        "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1},
        "eval": {"every": 0},
        "checkpoint": {"every": 3, "keep": 3, "resume": resume},
        "log": {"plot": False},
    })


def losses(out, first=1):
    rs = rows(out)
    assert [int(r["step"]) for r in rs] == list(range(first, STEPS + 1)), [r["step"] for r in rs]
    return [float(r["loss"]) for r in rs]


def test_sharded_optimizer_trains_saves_and_loads_at_another_layout(tmp_path):
    for name, layout in (("plain", {"dp": 2}), ("sharded", {"dp": 2, "dp_shard": "optimizer"})):
        r = train(config(tmp_path, name, layout), 2)
        assert r.returncode == 0, r.stdout[-3000:]
    plain, sharded = losses(tmp_path / "plain"), losses(tmp_path / "sharded")
    assert sharded == pytest.approx(plain, rel=1e-5), (sharded, plain)
    assert sharded[-1] < sharded[0] - 0.1                  # it trains
    ck = step_dir(str(tmp_path / "sharded" / "checkpoints"), 3)
    r = train(config(tmp_path, "again", {"dp": 2, "dp_shard": "optimizer"}, resume=ck), 2)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout[-3000:]
    assert losses(tmp_path / "again", 4) == sharded[3:]     # the whole optimizer state came back, bit for bit
    for name, layout, world in (("one", {"dp": 1}, 1),
                                ("grads", {"dp": 2, "dp_shard": "gradients", "microbatches": 2}, 2)):
        r = train(config(tmp_path, name, layout, resume=ck), world)
        assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout[-3000:]
        assert losses(tmp_path / name, 4) == pytest.approx(sharded[3:], rel=1e-5), name


def test_fully_sharded_saves_at_dp4_and_loads_at_dp2_optimizer_and_one_process(tmp_path):
    """The issue's round trip: a checkpoint written at dp 4 with dp_shard="full" (each rank holds a
    quarter of every parameter and of its optimizer state), resumed at dp 2 with the optimizer
    sharded, at one process and at dp 2 × pp 2 fully sharded (each rank cuts its halves of its
    stage's parameters from the whole tensors): the same losses to rounding."""
    r = train(config(tmp_path, "full", {"dp": 4, "dp_shard": "full"}), 4)
    assert r.returncode == 0, r.stdout[-3000:]
    full = losses(tmp_path / "full")
    assert full[-1] < full[0] - 0.1                         # it trains
    ck = step_dir(str(tmp_path / "full" / "checkpoints"), 3)
    for name, layout, world in (("dp2-optimizer", {"dp": 2, "dp_shard": "optimizer"}, 2), ("one", {"dp": 1}, 1),
                                ("dp2-pp2-full", {"dp": 2, "pp": 2, "microbatches": 2, "dp_shard": "full"}, 4)):
        r = train(config(tmp_path, name, layout, resume=ck), world)
        assert r.returncode == 0 and "resumed from" in r.stdout, r.stdout[-3000:]
        assert losses(tmp_path / name, 4) == pytest.approx(full[3:], rel=1e-5), name
