"""``ops.fp8_gather`` and ``passes/fp8_gather.py``: sequence parallelism's all-gather in FP8.

The op, on two ranks simulated by threads: each rank quantises its sequence shard and gathers
the FP8 bytes, and gets the bytes and scales that quantising the gathered bf16 tensor gives
(``fp8_quantize``), both recipes, the sequence first or second; the gradient reaching the
shard is the reduce-scatter of the gathered one. The pass: under tp2 + sp every gather that
only FP8 linears read is rewritten, a gather that a bf16 linear also reads is not (its node
says why), and the bf16 bytes no longer travel. Every HF family of tests/families.py at tp2 + sp
against its world-size-1 FP8 program (GPT and Llama, eager and compiled, are tests/test_fp8_pass.py's).
"""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import fxmegatron
from fxmegatron.ops.fp8_gather import fp8_gather_quantize, fp8_gathered_input, fp8_gathered_whole_input
from fxmegatron.ops.fp8_operands import fp8_quantize
from fxmegatron.ops.groups import SimulatedGroup
from tests import models
from tests.families import FAMILIES
from tests.fp8_reference import RECIPE_NAMES
from tests.test_fp8_pass import model_and_batch
from tests.distributed import run_distributed
from tests.workers.common import rel_err
from tests.workers.fp8 import family_step, fp8_sp_families, tp2_sp_graphs


def _on_ranks(fn, world=2):
    group = SimulatedGroup(world)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda r: fn(r, group.name(r)), range(world)))


_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _FP8_GPU,
                                                                                reason="needs an sm_89+ GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("dim", [0, 1])
def test_gathering_fp8_shards_is_quantising_the_gathered_tensor(recipe, dim, device):
    """On CUDA the shard goes through the Triton cast kernel, the reference through the same
    kernel on the gathered tensor."""
    g = torch.Generator().manual_seed(1)
    whole = (torch.randn(4, 6, 32, generator=g) * torch.linspace(0.01, 30, 32)).bfloat16().to(device)
    whole[1, 2] *= 200                         # one token far larger than the rest: row scales differ
    want = fp8_quantize(whole, recipe, "", "")
    shards = whole.chunk(2, dim)
    got = _on_ranks(lambda r, name: fp8_gather_quantize(shards[r].contiguous(), recipe, dim, 2, name))
    for r, outs in enumerate(got):
        for what, a, b in zip(("q", "scale", "qt", "scale_t"), outs, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (r, what, a.shape, b.shape)
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), (recipe, dim, r, what)


def test_a_missing_amax_reduction_would_show():
    """The check above can fail: without the group, a shard's own amax sets its scale."""
    whole = torch.randn(8, 32).bfloat16()
    whole[0] *= 100
    shards = whole.chunk(2, 0)
    want = fp8_quantize(whole, "tensorwise", "", "")
    alone = fp8_gather_quantize(shards[1].contiguous(), "tensorwise", 0, 1, "")
    assert not torch.equal(alone[1], want[1])


def test_the_gathered_input_moves_nothing_forward_and_reduce_scatters_its_gradient():
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(4, 6, 8, generator=g) for _ in range(2)]

    def rank(r, name):
        x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(r), requires_grad=True)
        y = fp8_gathered_input(x, 1, 2, name)
        assert y.shape == (4, 6, 8) and y.stride() == (0, 0, 0)
        y.backward(grads[r])
        return x.grad
    got = _on_ranks(rank)
    total = grads[0] + grads[1]
    for r in range(2):
        assert torch.equal(got[r], total[:, 3 * r:3 * r + 3])
    # all_gather_seq's stand-in: the gradient is whole on every rank, each keeps its slice
    x = torch.randn(4, 3, 8, requires_grad=True)
    fp8_gathered_whole_input(x, 1, 1, 2, "").backward(grads[0])
    assert torch.equal(x.grad, grads[0][:, 3:])


def test_under_sequence_parallelism_fp8_linears_read_gathered_fp8():
    cases = [("llama", "all"), ("llama", "attention"), ("gpt", "all"), ("falcon", "attention"),
             ("llama", ("q_proj",))]
    res = run_distributed(tp2_sp_graphs, 2, cases)[0]
    fp8, bf16, kinds, _, x_amax = res[("llama", "all")]
    # per layer: the attention's and the MLP's input (2 layers); the LM head's gather stays bf16
    assert fp8 == 4, (fp8, bf16)
    assert "fp8_gather_seq" in kinds and "gather_seq_grad" in kinds
    # fp8_report still sees each linear's input as the model has it (not the stand-in's zeros),
    # and its amaxes over the group are the whole operands' (a sharded weight's, a dy's)
    model, batch = model_and_batch("llama")
    want = {(r["module"], what): r[what]["amax"] for r in fxmegatron.parallelize(model, None, batch, precision="fp8")
            .fp8_report(batch) for what in ("x", "w", "dy")}
    assert x_amax.keys() == want.keys() and len(want) == 42
    bad = {k: (x_amax[k], v) for k, v in want.items() if x_amax[k] != pytest.approx(v, rel=1e-4)}
    assert not bad, bad
    fp8, bf16, _, readers, _ = res[("llama", "attention")]
    assert fp8 == 2 and readers == 6 and bf16 == [""] * 3, (fp8, readers, bf16)  # the MLPs' gathers: no FP8 reader
    # Falcon's fused qkv has a replicated weight here (one kv head): its input is all_gather_seq'd
    fp8, bf16, kinds, readers, _ = res[("falcon", "attention")]
    assert fp8 == 2 and readers == 2 and "all_gather_seq_grad" in kinds, (fp8, readers, kinds)
    # q in FP8, k and v in bf16: their one gather must stay bf16, and its node says why
    fp8, bf16, _, readers, _ = res[("llama", ("q_proj",))]
    assert fp8 == 0 and readers == 0 and sum("reads the gathered values" in why for why in bf16) == 2, bf16
    fp8, bf16, _, readers, _ = res[("gpt", "all")]
    assert fp8 == 4 and readers == 8, (fp8, bf16, readers)       # q, k, v and fc of each of the 2 layers


# every HF family of tests/families.py (the pass was written from GPT and Llama), one recipe each,
# alternating: Conv1D linears (gpt2), biased q/k/v (qwen2), soft-capping (gemma2), parallel
# attention + MLP (falcon), MoE (mixtral, qwen2_moe, olmoe), ...
SP_FAMILIES = [(name, ("tensorwise", "rowwise")[i % 2]) for i, name in enumerate(FAMILIES) if name != "llama"]


def test_every_family_at_tp2_sp_is_the_world_size_1_program():
    """Loss within 1e-5 and every gradient within 1e-4 of the world-size-1 FP8 program, on every
    family but at most two. Why not all: the tp program's fp32 differs from world size 1's by
    rounding (without FP8, every gradient of Gemma and Llama by about 3e-7), and FP8 rounding turns a
    1-ulp change next to a rounding boundary into a whole FP8 step (at world size 1, scaling
    the weights by 1 + 1e-6 moved Llama's gradients by up to 15%). Seen: Gemma rowwise, where
    one attention key gradient's amax moved by 6e-6 and 15 weight gradients by up to 1.5%,
    with or without sequence parallelism, gather in FP8 or not. A structural fault (a dropped
    amax reduction, a misordered gather) moves every family of its recipe."""
    per_rank = run_distributed(fp8_sp_families, 2, SP_FAMILIES)
    gathered, off = 0, {}
    for name, recipe in SP_FAMILIES:
        if per_rank[0][(name, recipe)][0] == "refused":
            continue
        model, batch = model_and_batch(name)
        loss1, grads1 = family_step(fxmegatron.parallelize(model, None, batch, precision="fp8", fp8_recipe=recipe),
                                    name)
        scale = 0.01 * max(g.abs().max().item() for g in grads1.values())
        for rank, res in enumerate(per_rank):
            loss2, grads2, n_gather = res[(name, recipe)]
            where = (name, recipe, f"rank {rank}")
            gathered += n_gather > 0
            assert abs(loss2 - loss1) <= 1e-5 * abs(loss1), (where, loss2, loss1)
            bad = {n: e for n, g in grads1.items() if (e := rel_err(grads2[n], g, scale)) > 1e-4}
            if bad:
                off[name] = max(off.get(name, 0.0), max(bad.values()))
    refused = [k for k in SP_FAMILIES if per_rank[0][k][0] == "refused"]
    print(f"tp2+sp refused for {refused}; FP8 gathers in {gathered // 2} of {len(SP_FAMILIES) - len(refused)}; "
          f"gradients off by more than 1e-4: {off}")
    assert len(off) <= 2, off
    assert len(refused) <= 4 and gathered // 2 >= len(SP_FAMILIES) - len(refused) - 4, (refused, gathered)
