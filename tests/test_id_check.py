"""Token ids and labels outside the vocabulary are named in the first steps, as the unmodified
model raises IndexError on them (issue: the vocab-parallel embedding and loss took zeros and
returned a loss)."""
import copy

import pytest
import torch

import fxmegatron
from fxmegatron.errors import BatchError
from tests import models
from tests.distributed import run_distributed
from tests.workers.loss_split import MOE, VOCAB, ids_outside_vocab_tp2, moe_batch


def _gpt():
    model, b = models.build("gpt"), models.batch("gpt", batch_size=4)
    return model, b, fxmegatron.parallelize(copy.deepcopy(model), None, b, microbatches=2)


@pytest.mark.parametrize("where, value, match", [
    (0, VOCAB, r"batch input 'args_0' \(microbatch 1 of the 2 .*\) holds 128 at \[0, 5\], outside the vocabulary of "
               r"128 rows that the embedding at node embedding in wte reads"),
    (0, -1, r"'args_0' .* holds -1 at \[0, 5\]"),
    (1, VOCAB + 7, r"batch input 'args_1' .* holds 135 .*the cross-entropy at node cross_entropy_loss reads "
                   r"\(0\.\.127; -100, its ignore_index, is allowed\)"),
    (1, -3, r"'args_1' .* holds -3"),
])
def test_bundled_gpt_ids_and_labels_outside_the_vocabulary(where, value, match):
    model, b, pm = _gpt()
    bad = [t.clone() for t in b]
    bad[where][2, 5] = value
    with pytest.raises(IndexError):
        model(*bad)                     # what the unmodified model does
    with pytest.raises(BatchError, match=match):
        pm.train_step(tuple(bad))
    assert all(p.grad is None for p in pm.parameters())      # refused before any forward


def test_ignored_labels_pass_and_the_checks_stop_after_three_steps():
    model, b, pm = _gpt()
    ok = (b[0], b[1].clone())
    ok[1][0, :4] = -100
    want = model(*ok).item()
    assert abs(pm.eval_step(ok).item() - want) <= 1e-5 * abs(want)
    assert pm.id_checks == 2
    pm.id_checks = 0                  # as pm.batch_checks: off
    bad = (b[0].clone(), b[1])
    bad[0][0, 0] = VOCAB
    pm.eval_step(bad)                 # no longer checked: the vocab-parallel lookup takes zeros


def test_hf_labels_are_checked_as_the_model_reads_them():
    """HF shifts its labels inside the model (labels[:, 0] is never read): the check runs on the
    shifted target, and names the batch key."""
    model, b = MOE["qwen3_moe"](False), moe_batch(0)
    pm = fxmegatron.parallelize(copy.deepcopy(model), None, b)
    first = {k: v.clone() for k, v in b.items()}
    first["labels"][1, 0] = VOCAB + 50       # not read by the model's loss
    want = model(**first).loss.item()
    assert abs(pm(first).item() - want) <= 1e-5 * abs(want)
    bad = {k: v.clone() for k, v in b.items()}
    bad["labels"][1, 3] = VOCAB
    with pytest.raises(IndexError):
        model(**bad)
    with pytest.raises(BatchError, match=r"batch input 'labels' holds 128 \(as the model reads it, computed from "
                                         r"'labels'\)"):
        pm(bad)
    bad = {k: v.clone() for k, v in b.items()}
    bad["input_ids"][0, 1] = VOCAB + 1
    with pytest.raises(BatchError, match=r"batch input 'input_ids' holds 129 at \[0, 1\].*embed_tokens"):
        pm(bad)


def test_tp2_vocab_parallel_ids_outside_the_vocabulary_on_gloo():
    for out in run_distributed(ids_outside_vocab_tp2, 2):
        for (name, key), msg in out.items():
            assert msg.startswith("batch input") and "outside the vocabulary of 128 rows" in msg, (name, key, msg)
            assert ("embedding" if key == "ids" else "cross-entropy") in msg, (name, key, msg)
