"""Pipeline parallelism: the split pass (one process) and the runtime on gloo.

gloo: pp=2 and pp=4 with v=1 and 2, and pp=2 x tp=2 on 4 processes, for the bundled GPT
and HF Llama: loss and gradients match the unmodified model under each schedule; an
exception on one pipeline rank ends every rank within 60 s.
"""
import copy
import itertools

import pytest
import torch

import fxmegatron
from fxmegatron.errors import PipelineSplitError as PipelineError
from fxmegatron.passes.pipeline_split import _balance, split_pipeline
from fxmegatron.schedules import ScheduleError
from tests import models
from tests.distributed import run_distributed
from tests.workers import pipeline_boundaries, pipeline_failure, pipeline_parity, rel_err

CONFIGS = [("1f1b", 1, 4), ("gpipe", 1, 4), ("gpipe", 2, 4), ("interleaved", 2, 4)]
MODELS = ("gpt", "llama")


# ---- one process -------------------------------------------------------------------------
def _chunks(name, n_layer, n_chunks, **kw):
    model = models.build(name, n_layer=n_layer)
    pm = fxmegatron.parallelize(model, None, models.batch(name))
    return pm, split_pipeline(pm.graph_module, n_chunks, **kw)


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_split_cuts_at_blocks_and_runs_like_the_whole_graph(name):
    pm, chunks = _chunks(name, 4, 3)
    assert chunks[0].units[0] == "pre" and chunks[-1].units[-1] == "post"
    blocks = [u for c in chunks for u in c.units if u not in ("pre", "post")]
    assert len(blocks) == 4 and len(set(blocks)) == 4          # each block in exactly one chunk
    assert all(any(u not in ("pre", "post") for u in c.units) for c in chunks)
    for a, b in zip(chunks, chunks[1:]):
        assert a.boundary_out == b.boundary_in
    import torch.utils._pytree as pytree
    from fxmegatron.capture import batch_args
    batch = models.batch(name)
    flat = pytree.tree_flatten(batch_args(batch))[0]
    vals = []
    for c in chunks:
        vals = c.gm(*vals, *[flat[i] for i in c.batch_inputs])
    assert torch.equal(vals[0], pm(batch))


def test_balance_is_optimal_and_the_head_weighs():
    for costs in ([5, 1, 1, 1, 1, 9], [1] * 7, [3, 8, 1, 1, 7, 2, 2]):
        for n in range(1, len(costs) + 1):
            sizes = _balance(costs, n)
            assert sum(sizes) == len(costs) and min(sizes) >= 1

            def worst(sz):
                out, i = [], 0
                for s in sz:
                    out.append(sum(costs[i:i + s]))
                    i += s
                return max(out)
            best = min(worst(s) for s in _compositions(len(costs), n))
            assert worst(sizes) == best
    # a large vocabulary makes the LM head + loss expensive: the last chunk gets fewer blocks
    from gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=8192, block_size=16, n_layer=6, n_head=4, n_embd=64))
    pm = fxmegatron.parallelize(model, None, models.batch("gpt"))
    chunks = split_pipeline(pm.graph_module, 2)
    n_blocks = [sum(u not in ("pre", "post") for u in c.units) for c in chunks]
    assert n_blocks[1] < n_blocks[0], n_blocks


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0,) + cuts + (total,)
        yield [b - a for a, b in zip(edges, edges[1:])]


def test_user_blocks_per_chunk_and_errors():
    _, chunks = _chunks("gpt", 4, 2, blocks_per_chunk=[1, 3])
    assert [sum(u not in ("pre", "post") for u in c.units) for c in chunks] == [1, 3]
    with pytest.raises(PipelineError, match=r"blocks_per_chunk=\[2, 3\] must have 2 entries.*summing to the 4"):
        _chunks("gpt", 4, 2, blocks_per_chunk=[2, 3])
    with pytest.raises(PipelineError, match="5 chunks, but the graph has only 4 transformer blocks"):
        _chunks("gpt", 4, 5)


def test_invalid_layouts_are_refused_before_tracing():
    b = models.batch("gpt", batch_size=4)
    with pytest.raises(ScheduleError, match="interleaved"):
        fxmegatron.parallelize(models.build("gpt"), None, b, virtual_stages=2, schedule="1f1b", microbatches=2)
    with pytest.raises(fxmegatron.FxMegatronError, match="microbatches=3 does not divide"):
        fxmegatron.parallelize(models.build("gpt"), None, b, microbatches=3)
    pm = fxmegatron.parallelize(models.build("gpt", n_layer=2), None, b, virtual_stages=2, microbatches=2)
    with pytest.raises(RuntimeError, match="call train_step"):
        pm(b)


@pytest.mark.parametrize("name", MODELS)
def test_one_process_virtual_stages_match(name):
    model = models.build(name, n_layer=4)
    b = models.batch(name, batch_size=4)
    ref = copy.deepcopy(model)
    loss_ref = models.call(ref, b)
    loss_ref.backward()
    scale = 0.01 * max(p.grad.abs().max().item() for p in ref.parameters())
    for sched, v in (("1f1b", 1), ("gpipe", 4), ("interleaved", 2)):
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2, virtual_stages=v, schedule=sched)
        loss = pm.train_step(b)
        assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
        grads = pm.full_grads()
        assert len(grads) == len(list(ref.parameters()))
        for n, p in ref.named_parameters():
            assert rel_err(grads[n], p.grad, scale) <= 1e-4, (sched, v, n)


@pytest.mark.parametrize("name", ["gpt", "gpt2"])
def test_microbatches_with_ignored_labels_average_like_the_whole_batch(name):
    model = models.build(name, n_layer=2)
    b = models.batch(name, batch_size=4)
    labels = b[1] if isinstance(b, tuple) else b["labels"]
    labels[:2, 3:] = -100        # the first microbatch counts far fewer tokens than the second
    ref = copy.deepcopy(model)
    loss_ref = models.call(ref, b)
    loss_ref.backward()
    scale = 0.01 * max(p.grad.abs().max().item() for p in ref.parameters())
    for v in (1, 2):
        pm = fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2, virtual_stages=v)
        loss = pm.train_step(b)
        assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), (loss.item(), loss_ref.item())
        grads = pm.full_grads()
        for n, p in ref.named_parameters():
            assert rel_err(grads[n], p.grad, scale) <= 1e-4, (v, n)


# ---- gloo ----------------------------------------------------------------------------------
LAYOUTS = [(2, 2), (4, 4), (4, 2)]    # (world, pp); tp = world / pp


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"pp{p}-tp{w // p}" for w, p in LAYOUTS])
def parity(request):
    world, pp = request.param
    n_layer = pp * max(v for _, v, _ in CONFIGS)     # one block per chunk at the most chunks: no more work
    return world, pp, n_layer, run_distributed(pipeline_parity, world, pp, MODELS, CONFIGS, n_layer)


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{s}-v{v}-m{m}" for s, v, m in CONFIGS])
@pytest.mark.parametrize("name", MODELS)
def test_pipeline_matches_unmodified_model(parity, name, config):
    world, pp, n_layer, per_rank = parity
    seen = set()
    for rank, res in enumerate(per_rank):
        r = res[(name,) + config]
        for a, b in zip(r["losses"], r["losses_ref"]):     # the loss arrives on every rank
            assert abs(a - b) <= 1e-5 * abs(b), (world, pp, rank, r["losses"], r["losses_ref"])
        bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
        assert not bad, f"pp={pp} rank {rank}: gradients differ: {bad}"
        seen |= set(r["grad_err"])
    assert len(seen) == len(list(models.build(name, n_layer=n_layer).parameters()))   # every parameter checked


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_pipeline_composes_with_sequence_parallel_and_recompute(recompute):
    configs = [("interleaved", 2, 4), ("1f1b", 1, 2)]
    per_rank = run_distributed(pipeline_parity, 4, 2, MODELS, configs, 4, 8, 2,
                               {"sequence_parallel": True, "recompute": recompute})
    for rank, res in enumerate(per_rank):
        for key, r in res.items():
            for a, b in zip(r["losses"], r["losses_ref"]):
                assert abs(a - b) <= 1e-5 * abs(b), (key, rank, r["losses"], r["losses_ref"])
            bad = {n: e for n, e in r["grad_err"].items() if e > 1e-4}
            assert not bad, (key, rank, bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,fail_rank", [(2, 1), (4, 2)])
def test_failure_on_one_rank_ends_every_rank(world, fail_rank):
    results = run_distributed(pipeline_failure, world, fail_rank)
    for rank, (kind, msg, seconds) in enumerate(results):
        assert seconds < 60, (rank, seconds)
        if rank == fail_rank:
            assert kind == "ValueError" and "injected failure" in msg
        else:
            assert kind == "PipelineError", (rank, kind, msg)
            assert f"rank {fail_rank}: ValueError: injected failure" in msg


def test_only_activations_cross_chunk_boundaries():
    """Values computed from parameters alone (sequence parallelism's copy_to_tp of every norm
    weight and bias) run in the chunk that uses them: a boundary carries the hidden state only.
    (Before, chunk 0 computed all of them and every boundary relayed them: 39 tensors per
    microbatch for the bundled GPT, and a hang on NCCL at tp2 x pp2 interleaved.)"""
    per_rank = run_distributed(pipeline_boundaries, 4, "gpt")
    for counts in per_rank:
        assert counts[-1] == 0 and all(c == 1 for c in counts[:-1]), counts
