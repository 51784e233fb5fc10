"""Expert parallelism (``parallelize(ep=...)``, folded onto the data-parallel ranks; the all-gather
dispatcher of passes/expert_parallel/rewrite.py, docs/EXPERT_PARALLEL.md).

On gloo, fp32, against the unmodified model: three SGD steps on different batches with masked
labels give its loss (1e-5) and every whole gradient (1e-4 of the largest), each rank holding
E/ep experts of every block, then eval_step's loss and the logits (1e-5; not under cp); at ep 2
and 4, ep2 × tp2 with sequence parallelism, ep2 × pp2 and microbatches, dp2 × cp2 at ep2, for HF
Mixtral, Qwen2-MoE (shared expert), OLMoE, Qwen3-MoE, DeepSeek-V3 (MLA, a sigmoid group router,
a shared expert; also ep2 × tp2), gpt-oss (expert biases; also with transformers' batched_mm
experts, the gathered dispatch) and Llama 4 (every token through every expert, the dense
dispatch; ep4 holds one expert a rank). What it does not follow is refused before anything
runs, naming the module (planning on one process)."""
import re

import pytest
import torch

from fxmegatron.capture import capture
from fxmegatron.errors import ExpertParallelError, MeshError, ShardingError
from fxmegatron.layout import Layout
from fxmegatron.lower.rank import build_rank
from fxmegatron.ops.dp_gather import shard_length
from tests.distributed import run_distributed
from tests.workers.expert_parallel import ep_checkpoint, ep_parity, ep_router_loss_refused

# layout -> (mesh, models, parallelize's keywords)
LAYOUTS = {
    "dp2-ep2": ({"dp": 2}, ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "gpt_oss@batched_mm"), {"ep": 2}),
    "dp4-ep4": ({"dp": 4}, ("mixtral", "llama4_text"), {"ep": 4}),
    "dp4-ep2-m2": ({"dp": 4}, ("qwen3_moe",), {"ep": 2, "microbatches": 2}),
    "dp2-tp2-sp-ep2": ({"dp": 2, "tp": 2}, ("qwen2_moe", "olmoe"), {"ep": 2, "sequence_parallel": True}),
    "dp2-pp2-ep2-m2": ({"dp": 2, "pp": 2}, ("mixtral",), {"ep": 2, "microbatches": 2}),
    "dp2-ep2-recompute": ({"dp": 2}, ("qwen2_moe",), {"ep": 2, "recompute": "full"}),
    "dp2-ep2-compile": ({"dp": 2}, ("qwen3_moe",), {"ep": 2, "compile": True}),
    # multi-head latent attention, a sigmoid group router and a shared expert; expert biases
    "dp2-ep2-deepseek-gpt_oss": ({"dp": 2}, ("deepseek_v3", "gpt_oss"), {"ep": 2}),
    "dp2-tp2-ep2-deepseek-gpt_oss-llama4": ({"dp": 2, "tp": 2}, ("deepseek_v3", "gpt_oss", "llama4_text"), {"ep": 2}),
    # context parallelism: an ep group at each cp rank, the experts' gradients summed over edp × cp
    "dp2-cp2-ep2": ({"dp": 2, "cp": 2}, ("qwen2_moe",), {"ep": 2}),
    # ZeRO-3: the dense weights sharded over dp, the experts over the ranks holding the same ones
    # (edp: none at dp = ep, whole there; two at dp4 ep2), each gathered before its block
    "dp2-ep2-full": ({"dp": 2}, ("mixtral", "qwen2_moe"), {"ep": 2, "dp_shard": "full"}),
    "dp4-ep2-full": ({"dp": 4}, ("mixtral", "qwen2_moe"), {"ep": 2, "dp_shard": "full"}),
    "dp4-ep2-full-recompute": ({"dp": 4}, ("qwen3_moe",), {"ep": 2, "dp_shard": "full", "recompute": "full"}),
}
EXPERTS = 4     # every model here


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_steps_match(layout):
    dims, names, kw = LAYOUTS[layout]
    world = 1
    for v in dims.values():
        world *= v
    check_ep_parity(run_distributed(ep_parity, world, dims, names, kw), dims, kw)


def check_ep_parity(per_rank, dims, kw):
    """``ep_parity``'s results at mesh ``dims`` and keywords ``kw`` against the unmodified model's
    (also tests/test_hybrid_sharding.py's, where the shards are one replica group's)."""
    ep = kw.get("ep", 1)
    group = dims["dp"] // kw.get("dp_replicate", 1)      # the dp ranks a weight's shards are over
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            for a, b in zip(r["losses"], r["losses_ref"]):
                assert abs(a - b) <= 1e-5 * abs(b), (rank, name, r["losses"], r["losses_ref"])
            ev, ev_ref = r["eval"]
            assert abs(ev - ev_ref) <= 1e-5 * abs(ev_ref), (rank, name, r["eval"])
            assert r["logits_err"] is None or r["logits_err"] <= 1e-5, (rank, name, r["logits_err"])
            for step, err in enumerate(r["errs"]):
                bad = {n: e for n, e in err.items() if e > 1e-4}
                assert not bad, (rank, name, step, bad)
            # every rank holds E/ep experts (a pipeline rank those of its stage's blocks)
            assert r["experts"] or "pp" in dims or ep == 1, (rank, name)
            for n, shape in r["experts"].items():
                assert shape[0] == EXPERTS // ep and r["whole"][n][0] == EXPERTS, (n, shape)
            if kw.get("dp_shard") == "full":    # every dense weight a shard of dp; an expert one of dp / ep
                for n, (held, local) in r["held"].items():
                    over = group // ep if n in r["experts"] else group
                    assert held == shard_length(local, over) if over > 1 else held == local, (n, held, local, over)


def _plan(model, batch, **layout):
    """The passes on one process, planning only (nothing materialised): the refusals come here."""
    return build_rank(capture(model, batch), Layout(**layout), {"dp": 0}, None, {})


def _moe(**kw):
    from tests.workers.loss_split import moe_batch, qwen3_moe
    return qwen3_moe(False, **kw), moe_batch(0)


def test_ep_that_does_not_divide_the_experts_is_refused_naming_the_block():
    model, b = _moe(num_experts=6)
    with pytest.raises(ExpertParallelError, match=r"ep=4 does not divide the 6 experts of model\.layers\.0\.mlp"):
        _plan(model, b, dp=4, ep=4)


def test_a_model_without_experts_and_forms_not_built_are_refused():
    from tests.families import FAMILIES, make_batch
    f = FAMILIES["llama"]
    with pytest.raises(ShardingError, match=r"ep=2\): the model has no mixture-of-experts block"):
        _plan(f.build(n_layer=1), make_batch(f, 0), dp=2, ep=2)
    from tests.test_expert_recognise import REFUSED, _ids_batch
    with pytest.raises(ExpertParallelError, match=r"model\.layers\.0\.mlp\.experts: step 'top-k' requires"):
        _plan(REFUSED["phimoe"][0](), _ids_batch(), dp=2, ep=2)


def test_ep_layouts_that_mean_nothing_are_refused_and_the_others_compose():
    with pytest.raises(ShardingError, match=r"the 6 of them do not split into groups of 4"):
        Layout(dp=6, ep=4)
    Layout(dp=2, cp=2, ep=2)        # built: the test above at dp2 × cp2
    for cp in (1, 2):       # with cp as without: every other option composes
        Layout(dp=4, cp=cp, ep=2, precision="fp8")      # test_ep_with_fp8_is_the_fp8_run_without_ep
        Layout(dp=4, cp=cp, ep=2, dp_shard="optimizer", dp_replicate=2)     # tests/test_hybrid_sharding.py
    with pytest.raises(ShardingError, match=r"ep=2, dp_replicate=4\): an ep group must lie inside one replica group"):
        Layout(dp=4, ep=2, dp_shard="optimizer", dp_replicate=4)
    Layout(dp=2, ep=2, dp_shard="optimizer")        # the sharded optimizer composes (tests/test_sharded_dp.py)
    Layout(dp=4, cp=2, ep=2, dp_shard="full")       # and ZeRO-3 (the experts over edp: test above)
    with pytest.raises(ShardingError, match=r"ep=0\): a number of expert-parallel ranks"):
        Layout(ep=0)
    import fxmegatron
    model, b = _moe()
    with pytest.raises((ShardingError, MeshError), match=r"ep=2.*data-parallel ranks"):
        fxmegatron.parallelize(model, None, b, ep=2)


def test_a_dense_dispatch_under_cp_is_refused_naming_the_block():
    """Context parallelism runs a block on the rank's tokens; the dense dispatch's [E, T, h] rows
    have no rule for it yet (Llama 4): refused by name, at ep2 as at ep1."""
    from tests.test_expert_recognise import _moe_tp
    from tests.workers.loss_split import moe_batch
    model, b = _moe_tp("llama4_text")[0], moe_batch(0, rows=4)
    for ep in (1, 2):
        with pytest.raises(ShardingError, match=r"context parallelism of model\.layers\.0\.feed_forward: its experts "
                                                r"are a dense dispatch .*leave cp at 1"):
            _plan(model, b, dp=2, cp=2, ep=ep)


@pytest.mark.parametrize("shard, world", [("none", 2), ("optimizer", 2), ("full", 4)])
def test_expert_shards_save_load_and_reshard_across_ep(tmp_path, shard, world):
    """Saved at ep2 (each rank of the first ep group writes its experts; under a sharded
    optimizer each rank its pieces of the state; under "full" at dp4 each rank its shards, the
    experts' cut over the two ranks holding the same ones), loaded at ep1 and saved, loaded at
    ep2: parameters and AdamW moments as saved, bitwise, and the next two steps' losses the
    saving run's. The "full" one is also loaded in one process: the same next loss."""
    runs = run_distributed(ep_checkpoint, world, str(tmp_path), shard)
    for r in runs:
        assert r["same_b"] == [] and r["same_c"] == [], r
        for tag in "bc":
            for got, want in zip(r[f"loss_{tag}"], r["loss_a"]):
                assert abs(got - want) <= 1e-6 * want, (tag, r)
    if shard == "full":
        import fxmegatron
        from fxmegatron.io import checkpoint
        from tests.workers.sharded_dp import _model_and_batches
        model, batch = _model_and_batches("mixtral")
        pm = fxmegatron.parallelize(model, None, batch(0))
        opt = pm.adamw(lr=1e-2)
        checkpoint.load(pm, opt, str(tmp_path / "a"))
        loss = pm.train_step(batch(21)).item()
        assert abs(loss - runs[0]["loss_a"][0]) <= 1e-6 * loss, (loss, runs[0]["loss_a"])


def test_verify_simulates_ep_and_names_a_wrong_dispatch(monkeypatch):
    """verify runs every rank of dp × cp × tp with its ep groups in one process: exact at ep2 (and
    ep2 × tp2 + sp, dp4 with two ep groups, dp2 × cp2 with an ep group per cp rank); a combine that
    returns each rank's token sums one row off is named at the first node reading the block's output."""
    import fxmegatron
    from fxmegatron.errors import VerificationError
    from fxmegatron.passes.expert_parallel import rewrite
    from tests.workers.sharded_dp import _model_and_batches
    for name, kw in (("mixtral", dict(tp=1, dp=2, ep=2)), ("qwen2_moe", dict(tp=2, dp=2, ep=2, sequence_parallel=True)),
                     ("qwen3_moe", dict(tp=1, dp=4, ep=2)), ("qwen2_moe", dict(tp=1, dp=2, cp=2, ep=2))):
        model, batch = _model_and_batches(name)
        report = fxmegatron.verify(model, batch(0), **kw)
        assert report.max_grad_err < 1e-4 and abs(report.loss - report.loss_ref) <= 1e-5 * report.loss_ref, report
        assert f"ep={kw['ep']}" in report.layout
    scatter = rewrite.scatter_seq
    monkeypatch.setattr(rewrite, "scatter_seq", lambda x, *a: scatter(x.roll(1, 0), *a))
    model, batch = _model_and_batches("mixtral")
    with pytest.raises(VerificationError, match=r"verify tp=1 dp=2 ep=2 .*first divergent node \w+ .*in model\.layers\.0"
                                                r"\.mlp.* reads the output of the expert-parallel block model\.layers\.0\.mlp"):
        fxmegatron.verify(model, batch(0), tp=1, dp=2, ep=2)


def test_a_router_loss_at_ep_with_microbatches_is_refused():
    """ep folds onto dp; with one microbatch the router's load-balancing loss is computed over the
    dp batch (tests/test_batch_term.py), with two the later microbatch's statistics are not there
    when the first's term is: refused by name, as for dp and microbatches (tests/test_loss_split.py)."""
    for msg in run_distributed(ep_router_loss_refused, 2):
        assert msg is not None and "router_aux_loss_coef" in msg and "output_router_logits=False" in msg, msg


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_verify_refuses_ep_with_a_sharded_optimizer_by_name(shard):
    """verify's simulated reduction shards every gradient over dp (and under "full" joins every
    shard over dp); the experts' are reduced and sharded over their own group: refused, pointing to
    the layout without sharding (which it runs)."""
    import fxmegatron
    from fxmegatron.errors import VerificationError
    from tests.workers.sharded_dp import _model_and_batches
    model, batch = _model_and_batches("mixtral")
    with pytest.raises(VerificationError, match=rf"verify\(ep=2, dp_shard='{shard}'\): not simulated yet.*"
                                                r"dp_shard='none'"):
        fxmegatron.verify(model, batch(0), dp=2, ep=2, dp_shard=shard)


def test_ep_with_fp8_is_the_fp8_run_without_ep():
    """FP8 (emulated on the CPU) at dp2 × ep2 is the FP8 run at dp2 (ep1) step by step: its linears
    (attention, a shared expert) run on each rank's own tokens at any ep, the experts' grouped GEMMs
    stay in bf16; losses and every whole gradient over three SGD steps, with FP8 linears present."""
    from tests.workers.ep_fp8 import ep_against_dp
    for name, fp8_at_least in (("mixtral", 8), ("qwen2_moe", 14)):
        for r in run_distributed(ep_against_dp, 2, name, {"precision": "fp8"}):
            (ref, got), errs = r["losses"], r["errs"]
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), (name, got, ref)
            assert max(max(e.values()) for e in errs) <= 1e-4, (name, errs)
            assert len(r["fp8"]) >= fp8_at_least, (name, r["fp8"])
