"""``ParallelModel.logits``: the logits the unmodified model's loss reads, forward only.

Against the unmodified model in eval mode (dropout 0.1 in the model, so a dropout left on
shows): the bundled GPT (its LM head's output) and HF Llama (``.logits``), at one process
(plain, fused, microbatches with recomputation, torch.compile) and on gloo: tp2 with
sequence parallelism (the whole vocabulary and each rank's shard), dp2 (each rank the
whole batch it is given), and cp2 (each rank the whole sequence). Each run checks that parameters, gradients, the dropout step,
torch's RNG and the modes are as before. Where the logits are found: through a shift of the
logits, from nll_loss over log_softmax; and the refusals (no cross-entropy, two of them, a
pipelined model, a batch of the wrong size or structure).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxmegatron
from fxmegatron.errors import BatchError, PassError
from tests import models
from tests.distributed import run_distributed
from tests.workers.logits import ids_only, logits_check, logits_layouts, reference_logits

# Triton's kernels run in the interpreter on CPU tensors here (conftest.py)
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def close(a, b):
    return a.shape == b.shape and (a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0)


# ---- one process ----------------------------------------------------------------------------
ONE = [("gpt", {}), ("gpt", {"fuse": True}), ("llama", {"microbatches": 2, "recompute": "selective"}),
       ("llama", {"compile": True})]


@pytest.mark.parametrize("name,kw", ONE, ids=[f"{n}-{'-'.join(k) or 'plain'}" for n, k in ONE])
def test_logits_one_process(name, kw):
    model = models.build(name, dropout=0.1)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch(name, batch_size=4), **kw)
    # compile=True: the logits run the fx graph; a train step would wait for inductor
    r = logits_check(pm, model, name, 4, train="compile" not in kw)
    assert r["whole"].shape == (4, models.SEQ, models.VOCAB)
    assert close(r["whole"], r["ref"]), (r["whole"] - r["ref"]).abs().max()
    assert torch.equal(r["shard"], r["whole"])          # tp=1: the shard is the whole vocabulary
    assert not r["changed"] and not r["requires_grad"], r["changed"][:5]
    pm.eval()                                           # the caller's mode is kept
    pm.logits(models.batch(name, batch_size=4))
    assert not any(m.training for m in pm.modules())


def test_logits_of_a_longer_batch_run_in_pieces():
    model = models.build("gpt")
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("gpt", batch_size=2))
    a, b = models.batch("gpt", seed=1), models.batch("gpt", seed=2)
    both = tuple(torch.cat([x, y]) for x, y in zip(a, b))
    assert torch.equal(pm.logits(both), torch.cat([pm.logits(a), pm.logits(b)]))
    assert close(pm.logits(both), reference_logits(model, "gpt", both))
    with pytest.raises(BatchError, match="pieces of 2 rows"):
        pm.logits(tuple(x[:1] for x in a))


def test_logits_refusals():
    model = models.build("llama")
    b = models.batch("llama", batch_size=2)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b)
    with pytest.raises(TypeError, match="missing inputs the logits read"):
        pm.logits({"labels": b["labels"]})
    with pytest.raises(TypeError, match="unknown inputs"):
        pm.logits({"input_ids": b["input_ids"], "mask": b["labels"]})
    piped = fxmegatron.parallelize(copy.deepcopy(model), None, models.batch("llama", batch_size=4),
                                   microbatches=2, virtual_stages=2)
    with pytest.raises(RuntimeError, match="pipeline stages.*eval_step"):
        piped.logits(b)


# ---- where the logits are found ---------------------------------------------------------------
class TinyLM(nn.Module):
    """An LM head over embeddings, with the loss written in one of several ways."""

    def __init__(self, loss):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.loss = nn.Embedding(32, 16), nn.Linear(16, 32), loss

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        if self.loss == "shift":     # the older HF way: the logits shifted, not the labels
            return F.cross_entropy(logits[:, :-1, :].reshape(-1, 32), labels[:, 1:].reshape(-1))
        if self.loss == "nll":
            return F.nll_loss(F.log_softmax(logits, -1).reshape(-1, 32), labels.reshape(-1))
        if self.loss == "two":
            flat = logits.reshape(-1, 32)
            return F.cross_entropy(flat, labels.reshape(-1)) + F.cross_entropy(flat * 2, labels.reshape(-1))
        return (logits ** 2).mean()


@pytest.mark.parametrize("loss", ["shift", "nll"])
def test_logits_found_through_a_shift_and_from_nll_loss(loss):
    model = TinyLM(loss)
    b = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b)
    with torch.no_grad():
        ref = model.head(torch.tanh(model.emb(b[0])))
    assert close(pm.logits(b[0]), ref)


@pytest.mark.parametrize("loss,match", [("mse", "no cross-entropy"), ("two", "2 cross-entropies")])
def test_logits_refused_when_not_found_unambiguously(loss, match):
    b = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    pm = fxmegatron.parallelize(TinyLM(loss), None, b)
    with pytest.raises(PassError, match=match):
        pm.logits(b)


# ---- gloo ------------------------------------------------------------------------------------
TWO = [("tp2-sp", (("tp", 2),), {"sequence_parallel": True}, ("gpt", "llama")),
       ("dp2", (("dp", 2),), {}, ("gpt",)),
       ("pp2", (("pp", 2), ("tp", 1)), {"microbatches": 2}, ("gpt",)),
       ("cp2", (("cp", 2),), {"dropout": 0.0}, ("llama",))]


@pytest.fixture(scope="module")
def two():
    return run_distributed(logits_layouts, 2, TWO)


def test_logits_tp2_sequence_parallel(two):
    for name in ("gpt", "llama"):
        for rank, res in enumerate(two):
            r = res[("tp2-sp", name)]
            v = models.VOCAB // 2
            assert close(r["whole"], r["ref"]), (name, rank, (r["whole"] - r["ref"]).abs().max())
            assert r["shard"].shape == (4, models.SEQ, v)
            assert close(r["shard"], r["ref"][..., r["tp_rank"] * v:(r["tp_rank"] + 1) * v]), (name, rank)
            assert not r["changed"] and not r["requires_grad"], (name, rank, r["changed"][:5])


def test_logits_data_parallel_runs_the_whole_batch_on_each_rank(two):
    for res in two:         # traced at 2 rows (4 over dp=2): the 4 rows run in two pieces, no dp share
        r = res[("dp2", "gpt")]
        assert r["whole"].shape == (4, models.SEQ, models.VOCAB) and close(r["whole"], r["ref"])
        assert torch.equal(r["shard"], r["whole"]) and not r["changed"]


def test_logits_context_parallel_put_the_sequence_back_in_order(two):
    # each cp rank computes its chunks (0 and 3, 1 and 2 of 4): the whole sequence on every rank
    for res in two:
        r = res[("cp2", "llama")]
        assert close(r["whole"], r["ref"]), (r["whole"].shape, r["ref"].shape)
        assert torch.equal(r["shard"], r["whole"]) and not r["changed"]


def test_logits_refused_with_pipeline_parallelism(two):
    for res in two:
        err = res[("pp2", "gpt")]["error"]
        assert err and "pp=2" in err and "last stage" in err and "eval_step" in err, err
