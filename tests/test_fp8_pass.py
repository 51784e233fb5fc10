"""``fxmegatron.passes.fp8`` and training with FP8 linears, on the CPU.

The pass on the bundled GPT, HF Llama, GPT-2 (Conv1D: addmm against an [in, out] weight) and
Falcon (``x @ W.T``): what became FP8, what stayed and why (LM head, alignment, a weight tied
to an embedding), the policies, after the tensor-parallel rewrite. Training: one step equal to a hand-written
FP8 model (tests/fp8_reference.py), ten AdamW steps that learn, numbers that differ from fp32
(a pass that silently did nothing fails), the dump. Tensor parallelism on gloo: the FP8
program at tp=2, with and without sequence parallelism (the sequence gathers in FP8:
``passes/fp8_gather.py``), and at pp=2 (1F1B, GPipe; 2
microbatches) gives the loss and gradients of the same program at world size 1, all through
``parallelize(precision="fp8")``.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmegatron
import fxmegatron.compiler
from fxmegatron.capture import capture, module_path
from fxmegatron.errors import PrecisionError
from fxmegatron.ops.fp8 import fp8_linear
from fxmegatron.ops.fp8_operands import fp8_linear_q
from fxmegatron.passes.fp8 import FP8_REPORT, FP8Policy, apply_fp8
from fxmegatron.passes.pipeline_split import node_flops
from fxmegatron.passes.runner import check_shapes
from tests import models
from tests.distributed import run_distributed
from tests.families import FAMILIES, make_batch
from tests.fp8_reference import RECIPE_NAMES, hand_fp8
from tests.helpers import transform
from tests.workers.common import rel_err
from tests.workers.fp8 import fp8_pp, fp8_tp, fp8_tp_compiled, one_step

aten = torch.ops.aten


# ---- the pass --------------------------------------------------------------------------------

FP8_COUNT = {"gpt": 12, "llama": 14, "gpt2": 8, "falcon": 8}


def model_and_batch(name, seed=0):
    """The test models, and HF Falcon (its linears are ``x @ W.T``: matmul against ``.T``)."""
    if name in FAMILIES:
        return FAMILIES[name].build(), make_batch(FAMILIES[name], seed)
    return models.build(name), models.batch(name, seed=seed)


def captured(name):
    return capture(*model_and_batch(name))


def outcomes(gm):
    return {path: what for path, _, what in gm.meta[FP8_REPORT]}


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2", "falcon"])
def test_pass_makes_block_linears_fp8_and_keeps_the_lm_head(name):
    cap = captured(name)
    apply_fp8(cap.gm, "all", "tensorwise")
    got = outcomes(cap.gm)
    assert sum(v == "fp8 tensorwise" for v in got.values()) == FP8_COUNT[name], got
    assert got["lm_head"] == "fp32: lm head (feeds the loss)"
    left = [n for n in cap.gm.graph.nodes
            if n.target in (aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default)
            and any(a.op == "get_attr" for a in n.all_input_nodes)]
    assert [module_path(n) for n in left] == ["lm_head"]
    nodes = [n for n in cap.gm.graph.nodes if n.target is fp8_linear]
    assert all(n.args[3:] == ("tensorwise", "", "") for n in nodes)
    if name == "gpt2":       # Conv1D's [in, out] weight: the linear's weight is its transpose
        assert all(n.args[1].target is aten.t.default and n.args[1].args[0].op == "get_attr" for n in nodes)
    check_shapes(cap.gm)
    n = nodes[0]
    x, out = n.args[0].meta["val"], n.meta["val"]
    assert node_flops(n, cap.gm) == 2 * out.numel() * x.shape[-1]     # pipeline balancing counts them


@pytest.mark.parametrize("name,policy,paths", [
    ("llama", "attention", {"q_proj", "k_proj", "v_proj", "o_proj"}),
    ("llama", "mlp", {"gate_proj", "up_proj", "down_proj"}),
    ("gpt2", "attention", {"c_attn", "c_proj"}),
    ("gpt", "mlp", {"fc", "proj"}),
    ("llama", [r"layers\.1\.mlp\.down_proj$", r"layers\.0\.self_attn\.q_proj$"], {"down_proj", "q_proj"}),
])
def test_policies(name, policy, paths):
    cap = captured(name)
    apply_fp8(cap.gm, policy, "rowwise")
    fp8_paths = {p for p, v in outcomes(cap.gm).items() if v == "fp8 rowwise"}
    assert {p.rsplit(".", 1)[-1] for p in fp8_paths} == paths
    part = {"attention": "attn", "mlp": "mlp"}.get(policy) if isinstance(policy, str) else None
    assert all(part in p for p in fp8_paths) if part else len(fp8_paths) == 2
    # what the policy does not select is left alone, unmarked
    assert all(("fp8" in n.meta) == (n.target is fp8_linear) for n in cap.gm.graph.nodes
               if n.target in (aten.linear.default, fp8_linear) and module_path(n) != "lm_head")


def test_lm_head_when_asked():
    cap = captured("gpt")
    apply_fp8(cap.gm, FP8Policy(lm_head=True), "tensorwise")
    assert outcomes(cap.gm)["lm_head"] == "fp8 tensorwise"


def test_bad_policies_and_recipes_are_errors():
    cap = captured("llama")
    with pytest.raises(PrecisionError, match=r"selects none of the 15 linear layers .*lm_head.*model\.layers"):
        apply_fp8(cap.gm, [r"\.encoder\."], "rowwise")
    for policy in ("encoder", [r"(unclosed"], 3):
        with pytest.raises(PrecisionError):
            apply_fp8(cap.gm, policy, "rowwise")
    with pytest.raises(PrecisionError, match="recipe='delayed'"):
        apply_fp8(cap.gm, "all", "delayed")
    assert not any(n.target is fp8_linear for n in cap.gm.graph.nodes)


class Toy(nn.Module):
    """An embedding whose weight a linear reads back (a tied head) under an MSE loss, and a
    linear of 24 input features."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 24)
        self.down = nn.Linear(24, 32)
        self.mlp = nn.Linear(32, 32)

    def forward(self, ids, target):
        h = self.mlp(self.down(self.up(self.emb(ids))))
        return F.mse_loss(F.linear(h, self.emb.weight), target)


def test_alignment_and_tied_weights_stay_high_precision():
    batch = (torch.randint(0, 64, (2, 16)), torch.randn(2, 16, 64))
    cap = capture(Toy(), batch)
    apply_fp8(cap.gm, "all", "tensorwise")
    got = outcomes(cap.gm)
    assert got == {"up": "fp32: out features 24 not a multiple of 16 (FP8 GEMM alignment)",
                   "down": "fp32: in features 24 not a multiple of 16 (FP8 GEMM alignment)",
                   "mlp": "fp8 tensorwise", "": "fp32: lm head (weight tied to an embedding)"}, got


@pytest.mark.parametrize("name", ["gpt", "gpt2"])
def test_pass_after_the_tensor_parallel_rewrite(name):
    _, _, gm = transform(models.build(name), models.batch(name), tp=2, rank=1, sequence_parallel=True)
    apply_fp8(gm, "all", "rowwise", "tp")
    split = {module_path(n).rsplit(".", 1)[-1]: n.args[5] for n in gm.graph.nodes if n.target is fp8_linear}
    want = {"q": "out", "k": "out", "v": "out", "proj": "in", "fc": "out"} if name == "gpt" else \
        {"c_attn": "out", "c_fc": "out", "c_proj": "in"}
    assert split == want
    assert all(n.args[4] == "tp" for n in gm.graph.nodes if n.target is fp8_linear)


# ---- training --------------------------------------------------------------------------------

def fp8_program(model, batch, recipe):
    return fxmegatron.parallelize(copy.deepcopy(model), None, batch, precision="fp8", fp8_recipe=recipe)


@pytest.mark.parametrize("name,recipe", [("gpt", "tensorwise"), ("llama", "rowwise"), ("falcon", "rowwise")])
def test_one_step_is_the_hand_written_fp8_model(name, recipe):
    model, batch = model_and_batch(name, seed=1)
    pm = fp8_program(model, batch, recipe)
    assert sum(1 for n in pm.graph_module.graph.nodes if n.target is fp8_linear_q) == FP8_COUNT[name]
    loss = pm(batch)
    loss.backward()
    grads = pm.full_grads()
    ref = hand_fp8(model, recipe)
    loss_ref = models.call(ref, batch)
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) <= 1e-6 * abs(loss_ref.item()), (loss.item(), loss_ref.item())
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    scale = 0.01 * max(g.abs().max().item() for g in ref_grads.values())
    bad = {n: e for n, g in ref_grads.items() if (e := rel_err(grads[n], g, scale)) > 1e-5}
    assert not bad, bad
    # FP8 shows: the fp32 model's loss is another number
    loss32 = models.call(copy.deepcopy(model), batch).item()
    assert 1e-5 < abs(loss.item() - loss32) / loss32 < 1e-2, (loss.item(), loss32)


def test_ten_adamw_steps_learn():
    model, batch = models.build("gpt"), models.batch("gpt", seed=2)
    pm = fp8_program(model, batch, "rowwise")
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        losses.append(pm.train_step(batch).item())
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.8 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses


def test_dump_shows_the_precision_of_each_linear(tmp_path):
    model, batch = models.build("gpt"), models.batch("gpt")
    pm = fp8_program(model, batch, "tensorwise")
    pm.dump(str(tmp_path))
    plan = (tmp_path / "rank0" / "plan.txt").read_text()
    assert "blocks.1.mlp.proj" in plan and plan.count("fp8 tensorwise") == 12
    assert "fp32: lm head (feeds the loss)" in plan
    # at world size 1 its group is empty: no amax is reduced, no collective listed
    assert "fp8_amax" not in (tmp_path / "rank0" / "collectives.txt").read_text()


# ---- tensor parallelism on gloo ------------------------------------------------------------------

TP_LAYOUTS = {name: [(recipe, sp) for recipe in RECIPE_NAMES for sp in (False, True)] for name in ("gpt", "llama")}


def test_tp2_is_the_world_size_1_program():
    per_rank = run_distributed(fp8_tp, 2, TP_LAYOUTS)
    for name, layouts in TP_LAYOUTS.items():
        for recipe, sp in layouts:
            pm = fxmegatron.parallelize(models.build(name), None, models.batch(name), precision="fp8",
                                        fp8_recipe=recipe)
            loss1, grads1 = one_step(pm, name)
            scale = 0.01 * max(g.abs().max().item() for g in grads1.values())
            for rank, res in enumerate(per_rank):
                loss2, grads2, n_fp8, n_amax, n_quant, n_quant_amax, n_gather = res[(name, recipe, sp)]
                where = (name, recipe, f"sp={sp}", f"rank {rank}")
                # every linear reduces dy's amaxes, every quantisation its operand's
                assert n_fp8 == n_amax == FP8_COUNT[name], (where, n_fp8, n_amax)
                assert n_quant == n_quant_amax and n_quant + n_gather > FP8_COUNT[name], (where, n_quant, n_quant_amax)
                # with sp, the attention's and the MLP's input of each of the 2 layers are gathered in FP8
                assert n_gather == (4 if sp else 0), (where, n_gather)
                assert abs(loss2 - loss1) <= 1e-5 * abs(loss1), (where, loss2, loss1)
                bad = {n: e for n, g in grads1.items() if (e := rel_err(grads2[n], g, scale)) > 1e-4}
                assert not bad, (where, bad)




def test_tp2_compiled_is_the_world_size_1_program():
    """With ``compile=True`` the FP8 ops are traced into inductor's graph (they are triton_ops),
    the amaxes' all-reduces with them: tp2 + sp still computes the eager world-size-1 program.
    Tensorwise: its scales are not powers of two, so a missing amax reduction shows in the
    values (rowwise's power-of-two scales hide it, see ``ops.fp8``)."""
    per_rank = run_distributed(fp8_tp_compiled, 2, "llama", "tensorwise")
    pm = fxmegatron.parallelize(models.build("llama"), None, models.batch("llama"), precision="fp8",
                                fp8_recipe="tensorwise")
    loss1, grads1 = one_step(pm, "llama")
    scale = 0.01 * max(g.abs().max().item() for g in grads1.values())
    for rank, (loss2, grads2) in enumerate(per_rank):
        assert abs(loss2 - loss1) <= 1e-5 * abs(loss1), (rank, loss2, loss1)
        bad = {n: e for n, g in grads1.items() if (e := rel_err(grads2[n], g, scale)) > 1e-4}
        assert not bad, (rank, bad)


PP_CASES = [("gpt", "tensorwise", "1f1b"), ("llama", "rowwise", "gpipe")]


@pytest.mark.parametrize("world,cases,sp", [(2, PP_CASES, False), (4, [("llama", "tensorwise", "1f1b")], True)],
                         ids=["pp2", "pp2xtp2-sp"])
def test_pp2_is_the_world_size_1_program(world, cases, sp):
    """Pipeline stages with FP8 linears (2 microbatches) give the loss and gradients of the same
    program in one process with the same microbatches: a weight lives whole on its stage, and
    each microbatch's activations are quantised alike in both. At pp2 x tp2 with sequence
    parallelism, the stages' sequence gathers move FP8 (``passes/fp8_gather.py``) too."""
    per_rank = run_distributed(fp8_pp, world, cases, sp)
    for name, recipe, schedule in cases:
        batch = models.batch(name, seed=7, batch_size=4)
        pm = fxmegatron.parallelize(models.build(name, n_layer=4), None, batch, microbatches=2, precision="fp8",
                                    fp8_recipe=recipe)
        loss1 = pm.train_step(batch).item()
        grads1 = pm.full_grads()
        scale = 0.01 * max(g.abs().max().item() for g in grads1.values())
        seen = set()
        for rank, res in enumerate(per_rank):
            loss2, grads2, gathers = res[(name, recipe, schedule)]
            where = (name, recipe, schedule, f"rank {rank}")
            # each stage holds 2 of the 4 layers: their attention's and MLP's inputs gathered in FP8
            assert gathers == (4 if sp else 0), (where, gathers)
            assert abs(loss2 - loss1) <= 1e-5 * abs(loss1), (where, loss2, loss1)
            bad = {n: e for n, g in grads2.items() if (e := rel_err(g, grads1[n], scale)) > 1e-4}
            assert not bad, (where, bad)
            seen |= grads2.keys()
        assert seen == grads1.keys()            # the two stages hold every parameter between them


def test_parallelize_names_a_bad_precision_recipe_or_combination():
    from fxmegatron.errors import PrecisionError
    model, batch = models.build("gpt", n_layer=1), models.batch("gpt")
    with pytest.raises(PrecisionError, match=r"precision='fp16'.*expected one of \('bf16', 'fp8'\)"):
        fxmegatron.parallelize(model, None, batch, precision="fp16")
    with pytest.raises(Exception, match="columnwise"):
        fxmegatron.parallelize(model, None, batch, precision="fp8", fp8_recipe="columnwise")
    with pytest.raises(PrecisionError, match="verify"):
        fxmegatron.parallelize(model, None, batch, precision="fp8", verify=True)


def test_the_fp8_report_lists_every_fp8_linear_with_its_operands_numbers():
    """``pm.fp8_report(batch)``: a row per FP8 linear (inside recomputed regions too), the
    amaxes of x, w and dy as the model has them (no parameter gradient left behind), and what FP8 does to them: a weight with one
    huge outlier has most of its entries flushed to zero, which the report shows."""
    from fxmegatron.runtime.fp8_report import format_report
    model, batch = models.build("llama", n_layer=1), models.batch("llama")
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, batch, precision="fp8", recompute="full")
    rows = pm.fp8_report(batch)
    assert len(rows) == FP8_COUNT["llama"] // 2 and all(r["recipe"] == "tensorwise" for r in rows)
    q = model.model.layers[0].self_attn.q_proj.weight
    row = next(r for r in rows if r["module"].endswith("q_proj"))
    assert row["w"]["amax"] == pytest.approx(q.abs().max().item()) and row["w"]["underflow"] == 0
    assert 0 < row["w"]["rel_error"] < 0.05 and row["x"]["saturated"] > 0
    # dy: the gradient of the loss at q_proj's output, as the unmodified model (in eval mode) has it
    ref = copy.deepcopy(model).eval()
    seen = []
    ref.model.layers[0].self_attn.q_proj.register_full_backward_hook(lambda m, gi, go: seen.append(go[0]))
    models.call(ref, batch).backward()
    assert row["dy"]["amax"] == pytest.approx(seen[0].abs().max().item(), rel=0.05)
    assert row["dy"]["underflow"] < 0.05 and 0 < row["dy"]["rel_error"] < 0.2
    assert all(r["dy"] is not None for r in rows) and all(p.grad is None for p in pm.parameters())
    with torch.no_grad():
        q[0, 0] = 1e6                                   # one outlier sets the tensor's scale
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, batch, precision="fp8")
    row = next(r for r in pm.fp8_report(batch) if r["module"].endswith("q_proj"))
    assert row["w"]["underflow"] > 0.5 and "q_proj" in format_report(pm.fp8_report(batch))
