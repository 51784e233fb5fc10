"""A loss that adds a term of batch statistics to its cross-entropy (an MoE router's
load-balancing loss, a z-loss) under data parallelism and expert parallelism folded onto it
(``passes/batch_term.py``): each replica computes the whole batch's term from the statistics
all-reduced over dp, and its cross-entropy is weighted in the graph.

On gloo, fp32, against the unmodified model with its router loss on (coefficient 0.1): three SGD
steps on different batches with masked labels give its loss (1e-5) and every whole gradient
(1e-4 of the largest), then eval_step's loss and the logits: HF Qwen3-MoE and Mixtral at dp2,
Qwen2-MoE (shared expert), gpt-oss and OLMoE (with an attention mask: the masked form of the
loss, ratios of sums) at dp2 × ep2, Mixtral with a mask at dp4 × ep2, OLMoE at dp4 × ep4 (one expert a rank), Qwen3-MoE at dp2 × tp2 ×
ep2 and at dp2 × ep2 with dp_shard="full" and compile=True (inductor on the CPU). ``verify`` agrees at dp2 (an empty microbatch in one replica) and names a planted wrong
statistic. Where the batch is split in other ways (microbatches, pp) the term is refused by name."""
import math

import pytest

import fxmegatron
from fxmegatron.capture import capture
from fxmegatron.errors import LossError, VerificationError
from fxmegatron.passes import batch_term
from tests.distributed import run_distributed
from tests.test_expert_parallel import check_ep_parity
from tests.workers.batch_term import head_parity
from tests.workers.expert_parallel import ep_parity
from tests.workers.loss_split import MOE, moe_batch

LAYOUTS = {
    "dp2": ({"dp": 2}, ("qwen3_moe+aux", "mixtral+aux"), {}),
    "dp2-ep2": ({"dp": 2}, ("qwen2_moe+aux", "gpt_oss+aux", "olmoe+auxmask"), {"ep": 2}),
    "dp4-ep2": ({"dp": 4}, ("mixtral+auxmask",), {"ep": 2}),
    "dp4-ep4": ({"dp": 4}, ("olmoe+aux",), {"ep": 4}),
    "dp2-tp2-ep2": ({"dp": 2, "tp": 2}, ("qwen3_moe+aux",), {"ep": 2}),
    "dp2-ep2-full-compile": ({"dp": 2}, ("qwen3_moe+aux",), {"ep": 2, "dp_shard": "full", "compile": True}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_router_loss_over_dp_is_the_model_s(layout):
    dims, names, kw = LAYOUTS[layout]
    check_ep_parity(run_distributed(ep_parity, math.prod(dims.values()), dims, names, kw), dims, kw)


def test_a_z_loss_and_a_weight_term_over_dp2_and_a_max_refused():
    """A mean over the tokens and a term of the weights alone are exact at dp2; the batch's largest
    logit (not a sum over tokens) is refused, naming the node."""
    for term in ("z_loss", "weights"):
        for r in run_distributed(head_parity, 2, term):
            assert "refused" not in r, r
            for a, b in zip(r["losses"], r["losses_ref"]):
                assert abs(a - b) <= 1e-5 * abs(b), (term, r)
            assert max(r["errs"]) <= 1e-4, (term, r)
    for r in run_distributed(head_parity, 2, "max"):
        assert "amax" in r.get("refused", ""), r
        assert "not only sums over its tokens" in r["refused"], r


def test_verify_agrees_at_dp2_and_names_a_planted_wrong_mean(monkeypatch):
    report = fxmegatron.verify(MOE["qwen3_moe"](True), moe_batch(0), tp=1, dp=2)
    assert abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref) and report.max_grad_err < 1e-4, report
    # planted: a mean's count not multiplied by dp (the batch's fraction taken as dp times larger)
    recognise = batch_term.recognise

    def planted(gm):
        plan, why = recognise(gm)
        if plan is not None:
            plan.stats = {s: st for s, st in plan.stats.items() if all(s is not d.args[0] for d in plan.means)}
            plan.means = []
        return plan, why
    monkeypatch.setattr(batch_term, "recognise", planted)
    with pytest.raises(VerificationError, match=r"verify tp=1 dp=2 .*differs"):
        fxmegatron.verify(MOE["qwen3_moe"](True), moe_batch(0), tp=1, dp=2)


@pytest.mark.parametrize("name", sorted(MOE))
def test_the_router_loss_of_each_family_is_recognised_with_and_without_a_mask(name):
    b = moe_batch(0)
    for batch in (b, {**b, "attention_mask": (b["labels"] != -100).long()}):
        plan, why = batch_term.recognise(capture(MOE[name](True), batch).gm)
        assert plan is not None, why
        # the experts' fractions and the router's mean probabilities: means, or ratios of masked sums
        assert len(plan.means) == 2 or len(plan.ratios) == 2, plan


def test_split_otherwise_the_term_is_refused_by_name():
    """Two microbatches: the later microbatch's statistics are not there when the first's term is
    computed; refused at planning, naming the term and the layout that computes it."""
    with pytest.raises(LossError, match=r"microbatches=2.*node add_.*computes such a term over the data-parallel "
                                        r"batch with dp alone \(one microbatch, no pp, cp or dp_replicate\), not "
                                        r"with this layout.*output_router_logits=False"):
        fxmegatron.parallelize(MOE["qwen3_moe"](True), None, moe_batch(0), microbatches=2)
