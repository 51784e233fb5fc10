"""``ParallelModel.eval_step``: the forward-only loss of a batch.

Against the unmodified model in eval mode under ``no_grad`` (dropout 0.1 in the model, so a
dropout left on shows; labels -100 in uneven places, so a wrong weighting shows), at one
process and on gloo: tp2 with sequence parallelism and recomputation, pp2 1F1B, pp2 interleaved
v2, dp2 x tp2 and dp2 x pp2. Each run checks that parameters, gradients (None ones too), the
dropout step, torch's RNG and the train/eval modes are as before, that the next train step
gives the loss and gradients it gives without the eval step, and what eval keeps in memory.
"""
import copy

import pytest
import torch

import fxmegatron
from fxmegatron.schedules import ScheduleError, forward_only, make_schedule, simulate
from fxmegatron.schedules.generate import add_communication
from tests import models
from tests.distributed import run_distributed
from tests.workers.eval_step import LiveBytes, SavedBytes, eval_check, eval_layouts, masked_batch

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")

NAMES = ("gpt", "gpt2")     # the bundled GPT with a tuple batch, HF GPT-2 with a dict batch


def check(r, where):
    assert abs(r["loss"] - r["ref"]) <= 1e-5 * abs(r["ref"]), (where, r["loss"], r["ref"])
    assert r["again"] == r["loss"], where
    assert not r["changed"], (where, r["changed"][:5])
    assert r["grads_stay_none"], where
    assert r["train_after"] == r["train"] and r["grads_match"], (where, r["train"], r["train_after"])
    assert r["saved_eval"] == 0 and r["saved_train"] > 0, where


# ---- schedules ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_forward_only_schedule_is_the_forwards_in_training_order(name):
    for p in (1, 2, 3, 4):
        for v in ((1,) if name == "1f1b" else (1, 2, 3)):
            for m in (p, 2 * p, 3 * p + (name != "interleaved")):
                train = make_schedule(name, p, v, m)
                s = forward_only(train)
                assert s.forward_only and all(a.kind in ("F", "SEND_F", "RECV_F") for acts in s.ranks for a in acts)
                for r in range(p):
                    assert s.computes(r) == [a for a in train.computes(r) if a.kind == "F"]
                res = simulate(s, f_time=1.0, b_time=2.0)          # raises on a deadlock
                assert res.busy == pytest.approx([m * 1.0] * p) and max(res.peak_in_flight) == 0
                bubble = (p - 1) / (v * m) if name == "interleaved" or v == 1 else None
                if bubble is not None:
                    assert all(abs(b - bubble) < 1e-9 for b in res.bubble_fraction), (name, p, v, m)


def test_simulator_refuses_backward_in_a_forward_only_schedule():
    train = make_schedule("1f1b", 2, 1, 2)
    s = forward_only(train)
    s.ranks[1] = s.ranks[1] + [a for a in train.ranks[1] if a.kind == "B"][:1]
    with pytest.raises(ScheduleError, match="B in a forward-only schedule"):
        simulate(s)
    s = forward_only(train)
    s.ranks[0] = [a for a in s.ranks[0] if a.kind != "F" or a.microbatch != 1]
    with pytest.raises(ScheduleError, match=r"missing compute F\(microbatch=1"):
        simulate(s)
    # another order of the same forwards can deadlock: the interleaved ring, rank 0 backwards
    s = forward_only(make_schedule("interleaved", 2, 2, 4))
    s.ranks[0] = add_communication(0, 2, 2, [(a.kind, a.microbatch, a.chunk) for a in s.computes(0)][::-1])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s)


# ---- one process ----------------------------------------------------------------------------
ONE_PROCESS = [{}, {"microbatches": 2},
               {"microbatches": 4, "virtual_stages": 2, "schedule": "interleaved", "recompute": "selective"}]


@pytest.mark.parametrize("name", NAMES)
def test_eval_step_one_process(name):
    model = models.build(name, dropout=0.1)
    for kw in ONE_PROCESS:
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name, batch_size=4), **kw)
        r = eval_check(pm, model, name, 4, measure=False)
        check(r, (name, kw))
        assert r["rng_steps"] == [kw.get("microbatches", 1)]     # one step per forward of a microbatch
        pm.eval()                           # the caller's mode is kept
        assert pm.eval_step(masked_batch(name, 7, 4)).item() == r["loss"] and not pm.training
        assert all(not m.training for m in pm.modules())


def test_forward_call_still_works():
    model = models.build("gpt", dropout=0.1)
    b = models.batch("gpt", batch_size=4)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b)
    ref = copy.deepcopy(model).eval()
    pm.eval()
    assert abs(pm(b).item() - models.call(ref, b).item()) <= 1e-5
    pm.train()
    loss = pm(b)
    loss.backward()                         # the training forward, graph and all
    assert loss.requires_grad and all(p.grad is not None for p in pm.parameters())
    piped = fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2, virtual_stages=2)
    with pytest.raises(RuntimeError, match="eval_step"):
        piped(b)


def test_eval_holds_one_boundary_between_chunks_and_saves_nothing():
    """Virtual stages on one process (the pipeline runtime, no sends): what is alive when a chunk
    is called does not pile up over the microbatches, and chunk 1 finds just the boundary that
    chunk 0 hands on more than chunk 0 found. (Under TRITON_INTERPRET the interpreter keeps the
    arguments of its last launch, the fused loss's logits: the same bytes at every call.)"""
    model = models.build("gpt")
    b = models.batch("gpt", batch_size=8)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=8, virtual_stages=2,
                                schedule="interleaved")
    runner = pm._runner
    tracker, held = LiveBytes(), []

    def watched(chunk):
        def call(*args):
            held.append(tracker.cur)
            return chunk(*args)
        return call

    runner.chunks = {c: watched(m) for c, m in runner.chunks.items()}
    with SavedBytes(pm.parameters()) as saved:
        pm.train_step(b)
    held.clear()
    with tracker:
        pm.eval_step(b)
    boundary = sum(torch.Size(s.shape).numel() * torch.empty((), dtype=s.dtype).element_size()
                   for s in pm.program.pipeline.specs[0])
    first, second = held[0::2], held[1::2]      # the order is F(i, 0), F(i, 1) for i = 0..7
    assert len(held) == 16 and first[0] == 0, held
    assert len(set(first[1:])) == 1 and all(s - f == boundary for f, s in zip(first, second)), (held, boundary)
    assert saved.bytes > 0 and tracker.peak < saved.bytes / 4, (tracker.peak, saved.bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_eval_step_peak_gpu_memory_is_below_the_train_steps():
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=8, n_embd=256, dropout=0.1)).cuda()
    g = torch.Generator().manual_seed(0)
    b = tuple(torch.randint(0, 512, (16, 256), generator=g).cuda() for _ in range(2))
    pm = fxmegatron.parallelize(model, None, b, microbatches=4, virtual_stages=2, schedule="interleaved")
    peaks = {}
    for step in ("train_step", "eval_step", "train_step", "eval_step"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        getattr(pm, step)(b)
        torch.cuda.synchronize()
        peaks[step] = torch.cuda.max_memory_allocated() - base
    assert peaks["eval_step"] < peaks["train_step"] / 4, peaks


# ---- gloo ------------------------------------------------------------------------------------
TP, PP = (("tp", 2),), (("pp", 2), ("tp", 1))
# one model per layout, for time: here every forward of the bundled GPT runs its fused loss in
# Triton's interpreter, and every process that builds GPT-2 imports transformers
TWO = [("tp2-sp-recompute", TP, {"sequence_parallel": True, "recompute": "selective", "microbatches": 2}, ("gpt",), 2),
       ("pp2-1f1b-m2", PP, {"schedule": "1f1b", "microbatches": 2}, ("gpt",), 2),
       ("pp2-v2-interleaved-m4", PP, {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4}, ("gpt2",), 4)]
FOUR = [("dp2-tp2", (("dp", 2), ("tp", 2)), {"microbatches": 2}, ("gpt",), 2),
        ("dp2-pp2", (("dp", 2), ("pp", 2), ("tp", 1)), {"microbatches": 2}, ("gpt",), 2)]


@pytest.fixture(scope="module")
def two():
    return run_distributed(eval_layouts, 2, TWO)


@pytest.fixture(scope="module")
def four():
    return run_distributed(eval_layouts, 4, FOUR)


def _check_ranks(per_rank, label, names):
    for name in names:
        rs = [res[(label, name)] for res in per_rank]
        for rank, r in enumerate(rs):
            check(r, (label, name, rank))
            assert r["loss"] == rs[0]["loss"], (label, name, [x["loss"] for x in rs])  # broadcast to every rank
            if "train_in_eval_mode" in r:
                assert abs(r["train_in_eval_mode"] - r["loss"]) <= 1e-6 * abs(r["loss"]), (label, name, rank)
            if label.startswith("pp"):      # the stage's own activations at most, not the train step's
                assert r["peak_eval"] < r["saved_train"], (label, name, rank, r["peak_eval"], r["saved_train"])


@pytest.mark.parametrize("label,names", [(t[0], t[3]) for t in TWO], ids=[t[0] for t in TWO])
def test_eval_step_two_processes(two, label, names):
    _check_ranks(two, label, names)


@pytest.mark.parametrize("label,names", [(t[0], t[3]) for t in FOUR], ids=[t[0] for t in FOUR])
def test_eval_step_four_processes(four, label, names):
    _check_ranks(four, label, names)
