"""Translation validation: every rank of a layout in one process, compared with the model in
eager; a planted wrong rule is caught and its node named."""
import resource
import subprocess
import sys

import pytest
import torch

import fxmegatron
from fxmegatron.errors import VerificationError
from fxmegatron.passes.tensor_parallel.rules import RULES
from fxmegatron.placement import R
from fxmegatron.verify import fresh_batch
from tests import models

aten = torch.ops.aten


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_exact_layouts_pass(name, tp, sp):
    report = fxmegatron.verify(models.build(name), models.batch(name), tp=tp, sequence_parallel=sp)
    assert report.max_grad_err < 1e-4 and abs(report.loss - report.loss_ref) <= 1e-5 * abs(report.loss_ref)
    assert report.coverage.flops_split > 0.99, report.coverage.summary()


def test_fresh_batch_differs_and_keeps_masks_and_padding():
    ids = torch.randint(2, 100, (2, 16))
    ids[:, -4:] = 1
    labels = ids.clone()
    labels[:, -4:] = -100
    b = fresh_batch({"input_ids": ids, "labels": ids, "masked": labels})
    assert not torch.equal(b["input_ids"], b["labels"])          # one tensor in the example, two here
    assert (b["masked"][:, -4:] == -100).all() and (b["input_ids"][:, -4:] == 1).all()
    assert (b["input_ids"][:, :-4] == 1).any()                    # the pad id also where the loss sees it


def _forget_the_reduction(real_rule):
    """A planted bug: the vocab-parallel embedding's output declared whole, so no g follows it."""
    def rule(view, node):
        real_rule(view, node)
        return view.set(node, R)
    rule.rule_name = real_rule.rule_name
    return rule


def test_a_planted_wrong_rule_is_named(monkeypatch):
    monkeypatch.setitem(RULES, aten.embedding, _forget_the_reduction(RULES[aten.embedding]))
    with pytest.raises(VerificationError) as err:
        fxmegatron.verify(models.build("llama"), models.batch("llama"), tp=2)
    msg = str(err.value)
    assert "first divergent node embedding (vocab_parallel_embedding) in model.embed_tokens" in msg, msg
    assert "rule 'embedding.vocab'" in msg and "rank 1 holds another value than rank 0" in msg, msg


def test_a_capture_that_misreads_the_batch_is_refused(monkeypatch):
    """The planted bug: inputs that share storage captured as one (export's own behaviour)."""
    import fxmegatron.capture.export as export
    monkeypatch.setattr(export, "distinct_inputs", lambda args, kwargs: (args, kwargs, []))
    x = models.batch("llama")["input_ids"]
    with pytest.raises(VerificationError, match=r"capture: .*does not read the batch as the model does"):
        fxmegatron.verify(models.build("llama"), {"input_ids": x, "labels": x}, tp=2)


@pytest.mark.slow
def test_cli_names_the_layouts_and_is_fast():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)      # CPU seconds: the wall clock of a busy machine varies
    out = subprocess.run([sys.executable, "-m", "fxmegatron.cli", "verify", "--factory",
                          "tests/factories/gpt_small.py:build", "--tp", "2,4", "--sequence-parallel", "both"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for layout in ("tp=2:", "tp=2 sp:", "tp=4:", "tp=4 sp:"):
        assert f"verify {layout} exact" in out.stdout, out.stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) < 60


def test_cli_verifies_a_trainer_config(capsys):
    """``fxmegatron verify CONFIG.toml``: the run's model (built on meta, given the weights a run
    starts from, a tied head kept tied), its first batch and its layout (pp2 x tp2 here)."""
    from fxmegatron.cli import _with_weights, main as cli_main
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    cfg, small = "examples/configs/gpt_tiny.toml", ["--set", "model.gpt.n_layer=2", "--set", "model.gpt.n_embd=32"]
    rc = cli_main(["verify", cfg, *small])
    out = capsys.readouterr().out
    assert rc == 0 and "verify tp=2 pp=2 m=2: exact" in out, out
    assert cli_main(["verify", cfg, "--set", "optim.learning_rate=1"]) == 2
    assert "fxmegatron verify: error: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["verify", cfg, "--factory", "tests/factories/gpt_small.py:build"])     # one of them
    prep = prepare(load(cfg, ["model.gpt.n_layer=1", "model.gpt.n_embd=32", "model.gpt.tie_embeddings=true"]), None)
    model = _with_weights(prep, prep.batch(prep.train.windows(0), "cpu"))
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.device.type == "cpu"
    assert not any(p.device.type == "meta" for p in model.parameters())
