"""verify at context-parallel layouts: every cp (and tp) rank simulated in one process against
the model in eager, and a planted wrong context-parallel rule named at its node."""
import dataclasses

import pytest
import torch

import fxmegatron
from fxmegatron.errors import VerificationError
from fxmegatron.ops.context_parallel import cp_take
from fxmegatron.passes.context_parallel.layout import seq as seq_placement
from fxmegatron.passes.context_parallel.registry import RULES
from fxmegatron.verify.context import join_sequence
from tests import models
from tests.families import FAMILIES, make_batch

aten = torch.ops.aten


def _model_and_batch(name):
    """The bundled GPT, or an HF family whose batch is padded (labels -100 where padded: the
    count of the loss's divisor differs between cp ranks)."""
    if name == "gpt":
        return models.build("gpt"), models.batch("gpt")
    fam = FAMILIES[name]
    return fam.build(), make_batch(fam, 0)


CELLS = [("gpt", 2, True, "ring"), ("llama", 1, False, "ring"),
         ("llama", 2, True, "ring"), ("llama", 2, False, "allgather")]


@pytest.mark.parametrize("name,tp,sp,variant", CELLS,
                         ids=[f"{n}-cp2-tp{t}{'-sp' if s else ''}-{v}" for n, t, s, v in CELLS])
def test_cp_layouts_are_exact(name, tp, sp, variant):
    model, batch = _model_and_batch(name)
    report = fxmegatron.verify(model, batch, cp=2, tp=tp, sequence_parallel=sp, cp_attention=variant)
    assert "cp=2" in report.layout, report.layout
    assert report.max_grad_err < 1e-4 and abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref), report


def test_a_replica_with_no_counted_token_adds_nothing_under_cp():
    """dp2 × cp2: verify masks every label of the last replica's batch. Its mean is 0/0 and weighted
    0; the cp rewrite's division by the cp ranks' count gave its gradient 0 · 1/0 = NaN, which
    the fused cross-entropy's backward (the GPU's, here Triton's interpreter) spread over every
    row and every parameter."""
    fam = FAMILIES["llama"]
    report = fxmegatron.verify(fam.build(n_layer=2), make_batch(fam, seed=0, batch_size=8), tp=1, dp=2, cp=2)
    assert report.layout == "tp=1 dp=2 cp=2" and report.max_grad_err < 1e-4, str(report)


def test_cli_checks_cp_layouts(capsys):
    from fxmegatron.cli import main as cli_main
    rc = cli_main(["verify", "--factory", "tests/factories/gpt_small.py:build", "--tp", "2", "--cp", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verify tp=2 cp=2: exact" in out, out


@pytest.mark.parametrize("dim,inner", [(1, 1), (0, 1), (2, 3)])
def test_join_sequence_undoes_cp_take(dim, inner):
    seq, cp = 8, 2
    shape = {1: [2, seq, 5], 0: [2 * seq, 5], 2: [2, 3, seq * inner]}[dim]
    x = torch.randn(shape)
    parts = [cp_take(x, dim, inner, seq, cp, r) for r in range(cp)]
    assert not torch.equal(parts[0], parts[1])
    torch.testing.assert_close(join_sequence(parts, seq_placement(dim, inner), seq), x, rtol=0, atol=0)


def _attention_without_exchange(real_rule):
    """A planted bug: the attention rule places attention on this rank's chunks but never asks
    for the other ranks' keys and values, so each rank attends over its own chunks only."""
    def rule(view, node, split):
        out = real_rule(view, node, split)
        return dataclasses.replace(out, note=None) if out.note == ("attention", None) else out
    return rule


@pytest.mark.parametrize("tp", [1, 2])
def test_a_planted_wrong_attention_rule_is_named(monkeypatch, tp):
    sdpa = aten.scaled_dot_product_attention
    monkeypatch.setitem(RULES, sdpa, _attention_without_exchange(RULES[sdpa]))
    model, batch = _model_and_batch("llama")
    with pytest.raises(VerificationError) as err:
        fxmegatron.verify(model, batch, cp=2, tp=tp)
    msg = str(err.value)
    assert ("first divergent node scaled_dot_product_attention (scaled_dot_product_attention.default) in "
            "model.layers.0.self_attn") in msg, msg
    assert "cp S(2, seq) by cp rule 'attention'" in msg and "differs from the original by" in msg, msg


def _local_mean_as_partial(real_rule):
    """A planted bug: the loss rule declares the mean over this rank's tokens a partial sum over cp
    (no rewrite to this rank's sum over every rank's count), so the ranks' means get added."""
    def rule(view, node, split):
        out = real_rule(view, node, split)
        return dataclasses.replace(out, note=None) if out.note and out.note[0] == "mean_loss" else out
    return rule


def test_a_planted_wrong_loss_placement_is_named(monkeypatch):
    ce = aten.cross_entropy_loss
    monkeypatch.setitem(RULES, ce, _local_mean_as_partial(RULES[ce]))
    model, batch = _model_and_batch("gpt")
    with pytest.raises(VerificationError) as err:
        fxmegatron.verify(model, batch, cp=2, tp=2)
    msg = str(err.value)
    assert "first divergent node cross_entropy_loss (" in msg, msg
    assert "cp P(sum) by cp rule 'loss.partial'" in msg and "differs from the original by" in msg, msg


class _PooledThenTransposed(torch.nn.Module):
    """A loss from a sum over the sequence (under cp: a partial sum on each rank), transposed and
    squared: the partial sum must be made whole before the square, not read as whole."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)

    def forward(self, ids):
        pooled = self.emb(ids).sum(1)           # [B, H], a partial sum over cp
        return (pooled.t() * pooled.t()).mean()


def test_a_partial_sum_through_a_transpose_is_summed_first():
    torch.manual_seed(0)
    report = fxmegatron.verify(_PooledThenTransposed(), (torch.randint(0, 32, (2, 8)),), cp=2)   # raises if not exact
    assert report.max_grad_err < 1e-4 and abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref), report
