"""The dry-run plan (``fxmegatron.train.plan``): parameter counts per rank add up to the model's,
the activation estimate on meta matches the bytes a real run saves for backward, and the
microbatches in flight are the schedule's."""
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

from tests.families import FAMILIES, make_batch
from fxmegatron.capture import capture
from fxmegatron.kernels.multi_tensor import flat_offsets
from fxmegatron.models.gpt import GPT, GPTConfig
from fxmegatron.runtime.memory import saved_bytes
from fxmegatron.schedules import make_schedule, simulate
from fxmegatron.train.plan import plan_run
from fxmegatron.train.plan_memory import grad_bytes, in_flight, optimizer_bytes
from fxmegatron.verify.pipeline import Layout, build_program
from fxmegatron.verify.simulate import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 16


def gpt(n_layer=2):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=64)).train()


def gpt_batch(rows=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 128, (rows, SEQ), generator=g), torch.randint(0, 128, (rows, SEQ), generator=g))


def llama(n_layer=2):
    return FAMILIES["llama"].build(n_layer)


def llama_batch(rows=2):
    return make_batch(FAMILIES["llama"], 0, rows)


MODELS = {"gpt": (gpt, gpt_batch), "llama": (llama, llama_batch)}


def measured(model, batch, tp=1, sequence_parallel=False, recompute="none"):
    """Bytes saved for backward by tp rank 0 of the real program on CPU (parameters excluded), the
    program built by the compiler's passes (``verify``'s simulated ranks for tp > 1)."""
    cap = capture(model, batch)
    flat = list(batch) if isinstance(batch, tuple) else list(batch.values())

    def body(rank, group):
        prog = build_program(cap, Layout(tp=tp, sequence_parallel=sequence_parallel, recompute=recompute), rank,
                             group, 0, 0, False, False)
        mod = prog.modules[0]
        with saved_bytes(exclude=list(mod.parameters())) as out:
            loss = mod(*flat)
        (loss[0] if isinstance(loss, (tuple, list)) else loss).backward()
        return out["bytes"]

    return run_ranks(tp, body)[0]


# ---- parameters ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_parameter_counts_per_rank_add_up_to_the_model(name):
    build, batch = MODELS[name]
    model = build(4)
    plan = plan_run(model, batch(4), pp=2, tp=2, microbatches=2)
    whole = {n: p.numel() for n, p in model.named_parameters()}    # tied weights once
    assert plan.model_params == sum(whole.values())
    for s in plan.stages:
        assert s.params == s.split + s.replicated
        # independent of the placements: the stage's tp ranks together hold each of its parameters once
        assert s.stage_params == sum(whole[n] for n in s.names)
    held = [n for s in plan.stages for n in s.names]
    assert set(held) | set(plan.unused) == set(whole)
    assert sum(s.stage_params for s in plan.stages) == plan.model_params + plan.tied_copies - plan.unused_numel
    if name == "gpt":    # the tied embedding and LM head: a copy on the first and the last pipeline rank
        assert plan.tied == {"wte.weight": (0, 1)} and plan.tied_copies == whole["wte.weight"]
        assert "tied: wte.weight (also lm_head.weight) is held by pp ranks 0, 1" in plan.format()
    else:
        assert plan.tied == {} and plan.tied_copies == 0
    assert plan.stages[0].replicated > 0 and plan.stages[0].split > 10 * plan.stages[0].replicated


def test_optimizer_and_gradient_bytes():
    bf16 = [(100, torch.bfloat16), (64, torch.bfloat16)]
    assert optimizer_bytes(bf16, "adamw") == 2 * 164 * 2 + 2 * 4           # moments in bf16, a step each
    assert optimizer_bytes(bf16, "fused_adamw") == 12 * (128 + 64)         # fp32 master, m, v; padded to 64
    assert grad_bytes(bf16, False) == 164 * 2
    assert grad_bytes(bf16, True) == 164 * 2 + 4 * (128 + 64)              # + the fp32 sums
    assert grad_bytes([(100, torch.float32)], True) == 400                 # fp32 needs no separate sum
    plan = plan_run(gpt(), gpt_batch(4), tp=2, microbatches=2, param_dtype=torch.bfloat16,
                    optimizer="fused_adamw", grad_accum_dtype=torch.float32)
    s = plan.stages[0]
    assert s.param_bytes == 2 * s.params
    assert s.optimizer_bytes == 12 * flat_offsets(list(s.local.values()))[1]
    assert s.grad_bytes == 2 * s.params + 4 * flat_offsets(list(s.local.values()))[1]


# ---- activations --------------------------------------------------------------------------------
LAYOUTS = [(torch.float32, 1, False, "none"), (torch.bfloat16, 1, False, "none"), (torch.bfloat16, 2, False, "none"),
           (torch.bfloat16, 2, True, "none"), (torch.bfloat16, 1, False, "selective"),
           (torch.bfloat16, 1, False, "full")]


@pytest.fixture(scope="module")
def estimates():
    """{(model, dtype, tp, sequence_parallel, recompute): (the plan's one stage, bytes measured)}
    without a pipeline, on one process (tp 1) and on simulated tp ranks (tp 2). The recompute
    modes on the GPT only (its blocks are what full recompute outlines, the same for both)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        # the plan and the run as on a GPU: the CPU runs fxmegatron's kernels (the fused loss, which
        # keeps no fp32 logits) only in Triton's interpreter (conftest.py's triton_interpreter)
        if not torch.cuda.is_available():
            mp.setenv("TRITON_INTERPRET", "1")
        for name, (build, batch) in MODELS.items():
            for dtype, tp, sp, rc in LAYOUTS:
                if rc != "none" and name != "gpt":
                    continue
                model = build().to(dtype)
                stage = plan_run(model, batch(), tp=tp, sequence_parallel=sp, recompute=rc, device="cpu").stages[0]
                assert stage.in_flight == {0: 1} and stage.activation_bytes == stage.saved[0]
                out[name, dtype, tp, sp, rc] = (stage, measured(model, batch(), tp, sp, rc))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_activation_estimate_matches_the_bytes_a_real_run_saves(estimates, name):
    for key, (stage, real) in estimates.items():
        if key[0] == name:
            assert abs(stage.saved[0] / real - 1) < 0.10, (key, stage.saved[0], real)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_with_sequence_parallel_roughly_halves_the_activations(estimates, name):
    one, tp2, sp = (estimates[name, torch.bfloat16, tp, sp, "none"][0].saved[0]
                    for tp, sp in ((1, False), (2, False), (2, True)))
    assert 0.4 < sp / one < 0.6, (one, sp)
    assert sp < 0.9 * tp2, (tp2, sp)      # sequence parallelism splits what tp alone keeps whole: the norms' part


def test_full_recompute_keeps_block_inputs_and_recomputes_one_block_at_a_time(estimates):
    none, full = (estimates["gpt", torch.bfloat16, 1, False, rc][0] for rc in ("none", "full"))
    assert none.recompute_bytes == 0 and full.saved[0] < none.saved[0] / 3
    # while one block's backward runs, that block's activations exist again: what full recompute saved, per block
    assert abs(full.recompute_bytes / ((none.saved[0] - full.saved[0]) / 2) - 1) < 0.1
    assert full.total_bytes == full.param_bytes + full.grad_bytes + full.optimizer_bytes + full.saved[0] + \
        full.recompute_bytes


# ---- the schedule -------------------------------------------------------------------------------
def test_in_flight_is_the_schedules():
    s = make_schedule("1f1b", 4, 1, 8)
    assert [in_flight(s, r, {r: 1})[1][r] for r in range(4)] == [4, 3, 2, 1] == simulate(s).peak_in_flight
    s = make_schedule("gpipe", 4, 1, 8)
    assert [in_flight(s, r, {r: 1})[1][r] for r in range(4)] == [8] * 4
    # interleaved: counted per (microbatch, chunk), as the simulator does
    s = make_schedule("interleaved", 4, 2, 8)
    assert [in_flight(s, r, {r: 1, r + 4: 1})[0] for r in range(4)] == simulate(s).peak_in_flight_chunks


@pytest.mark.parametrize("schedule, expected", [("1f1b", [4, 3, 2, 1]), ("gpipe", [8] * 4)])
def test_plan_keeps_the_schedules_microbatches_in_flight(schedule, expected):
    plan = plan_run(gpt(4), gpt_batch(8), pp=4, microbatches=8, schedule=schedule)
    assert [s.in_flight[s.pp_rank] for s in plan.stages] == expected
    for s in plan.stages:
        assert s.activation_bytes == s.saved[s.pp_rank] * s.in_flight[s.pp_rank]
        assert s.total_bytes == s.param_bytes + s.grad_bytes + s.optimizer_bytes + s.activation_bytes
    text = plan.format()
    assert f"Schedule {schedule}: p=4, v=1, m=8" in text and "rank 3 |" in text
    assert "activations = " in text and "an estimate" in text


# ---- the 8B dry run -----------------------------------------------------------------------------
@pytest.mark.slow
def test_llama8b_dry_run_under_30_s():
    """Timed by the child's CPU seconds, not the wall clock: on a 2-core machine busy with other
    tests the wall time of the same run has reached 50 s."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "fxmegatron.train.plan", "--llama8b", "--pp", "4", "--tp", "2",
                          "--microbatches", "8", "--seq", "8192"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "8,030,261,248 parameters" in out.stdout
    rss = float(re.search(r"peak RSS of this process: ([\d.]+) GiB", out.stdout).group(1))
    assert cpu < 30 and rss < 4, (cpu, rss)


def test_cp2_halves_the_activations_not_the_parameters():
    """``plan_run(cp=2)`` plans cp rank 0's graph: its two chunks of the sequence."""
    one, cp2 = (plan_run(gpt(), gpt_batch(), cp=cp, device="cpu") for cp in (1, 2))
    assert cp2.stages[0].params == one.stages[0].params
    assert 0.4 < cp2.stages[0].activation_bytes / one.stages[0].activation_bytes < 0.6
    assert "dp 1 × pp 1 × cp 2 × tp 1 = 2 ranks" in cp2.format()


def test_sharded_data_parallelism_divides_what_each_mode_shards():
    """dp_shard: "optimizer" counts 1/(dp·cp) of the optimizer's state per rank, "gradients" of
    the gradients too, "full" of the parameters as well; activations are the same."""
    modes = ("none", "optimizer", "gradients", "full")
    plans = {m: plan_run(gpt(), gpt_batch(4), dp=2, cp=2, param_dtype=torch.bfloat16, optimizer="fused_adamw",
                         device="cpu", dp_shard=m) for m in modes}
    none, opt, grads, full = (plans[m].stages[0] for m in modes)
    assert opt.optimizer_bytes == -(-none.optimizer_bytes // 4) and opt.param_bytes == none.param_bytes
    assert opt.grad_bytes == none.grad_bytes
    assert (grads.optimizer_bytes, grads.param_bytes) == (opt.optimizer_bytes, none.param_bytes)
    assert grads.grad_bytes == -(-none.grad_bytes // 4)
    assert full.optimizer_bytes == opt.optimizer_bytes
    assert full.param_bytes == -(-none.param_bytes // 4) and full.grad_bytes == -(-none.grad_bytes // 4)
    assert full.activation_bytes == none.activation_bytes
    assert "gradients and optimizer state split over 4 ranks (dp·cp)" in plans["full"].format()


def test_hybrid_sharding_divides_by_one_replica_groups_ranks():
    """dp_replicate: the pieces are over dp·cp / dp_replicate ranks, and plan.txt says so."""
    from fxmegatron.layout import Layout
    kw = dict(param_dtype=torch.bfloat16, optimizer="fused_adamw", device="cpu")
    flat = plan_run(gpt(), gpt_batch(4), layout=Layout(dp=4, dp_shard="full"), **kw)
    hybrid = plan_run(gpt(), gpt_batch(4), layout=Layout(dp=4, dp_shard="full", dp_replicate=2), **kw)
    none = plan_run(gpt(), gpt_batch(4), layout=Layout(dp=4), **kw)
    assert hybrid.stages[0].param_bytes == -(-none.stages[0].param_bytes // 2)
    assert flat.stages[0].param_bytes == -(-none.stages[0].param_bytes // 4)
    assert "split over 2 ranks (dp·cp / dp_replicate)" in hybrid.format()


def test_expert_parallelism_counts_each_ranks_experts_and_shards_their_state_apart():
    """ep: every expert weight (an HF Qwen3-MoE's ``mlp.experts.*``) is held 1/ep a rank, the rest
    whole; with dp_shard="optimizer" at dp4 × ep2 the experts' state is over the 2 ranks holding
    them and the rest over 4; activations grow by the tokens the dispatcher gathers."""
    from fxmegatron.layout import Layout
    from tests.workers.loss_split import moe_batch, qwen3_moe
    model, batch = qwen3_moe(False), moe_batch(0, rows=8)
    whole = {n: p.numel() for n, p in model.named_parameters()}
    kw = dict(optimizer="fused_adamw", device="cpu")
    one, ep2, sharded = (plan_run(model, batch, layout=Layout(**lay), **kw) for lay in
                         (dict(dp=2), dict(dp=2, ep=2), dict(dp=4, ep=2, dp_shard="optimizer")))
    experts = {n for n in whole if ".mlp.experts." in n}
    assert experts
    for plan in (ep2, sharded):
        st = plan.stages[0]
        for n, k in st.local.items():
            assert k * (2 if n in experts else 1) == whole[n], n
        assert st.experts == sum(whole[n] for n in experts) // 2
        assert st.stage_params + st.expert_stage == one.stages[0].stage_params == plan.model_params
    s1, st = ep2.stages[0], sharded.stages[0]
    dense = s1.optimizer_bytes - s1.expert_optimizer_bytes
    assert st.optimizer_bytes == -(-dense // 4) + -(-s1.expert_optimizer_bytes // 2)
    assert s1.optimizer_bytes < one.stages[0].optimizer_bytes
    assert s1.activation_bytes > one.stages[0].activation_bytes
    assert "the experts' over 2 (the ranks holding the same experts)" in sharded.format()
