"""Capture is faithful to how users call their models, and run-time batches that do not fit
the captured program are named, never silently mis-read (issue: translation validation)."""
import copy

import pytest
import torch
import torch.nn as nn

import fxmegatron
from fxmegatron.errors import BatchError, CaptureError
from tests.distributed import run_distributed

VOCAB, PAD = 128, 1


def _llama(dropout=0.0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=dropout,
               pad_token_id=PAD)     # HF's defaults otherwise: use_cache=True
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg)).train()


def _padded(seed, rows=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (rows, seq), generator=g)
    ids[:, 3] = PAD                      # the pad id where the loss sees it
    ids[0, -4:] = PAD                    # right padding, masked
    labels = ids.clone()
    labels[0, -4:] = -100
    return {"input_ids": ids, "labels": labels}


def test_labels_given_as_input_ids_is_captured_as_two_inputs():
    model = _llama()
    ref = copy.deepcopy(model)
    x = torch.randint(2, VOCAB, (2, 16))
    pm = fxmegatron.parallelize(model, None, {"input_ids": x, "labels": x})   # the HF idiom: one tensor
    assert any("shares storage" in n for n in pm.notes), pm.notes
    opt, opt_ref = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        b = _padded(step)
        loss, loss_ref = pm(b), ref(**b).loss
        loss.backward()
        loss_ref.backward()
        assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), (step, loss, loss_ref)
        opt.step(); opt.zero_grad()
        opt_ref.step(); opt_ref.zero_grad()


def test_default_hf_config_has_no_cache_in_the_graph_and_attention_is_split():
    model = _llama()
    assert model.config.use_cache
    pm = fxmegatron.parallelize(model, None, _padded(0))
    assert any("use_cache=False" in n for n in pm.notes), pm.notes
    report = fxmegatron.verify(_llama(), _padded(0), tp=2)
    assert report.coverage.flops_split > 0.99, report.coverage.summary()


def test_a_last_partial_batch_names_both_shapes():
    pm = fxmegatron.parallelize(_llama(), None, _padded(0))
    small = {k: v[:1] for k, v in _padded(1).items()}
    with pytest.raises(BatchError, match=r"'input_ids'.*\[1, 16\] int64.*captured for \[2, 16\] int64"):
        pm(small)
    pm4 = fxmegatron.parallelize(_llama(), None, _padded(0), microbatches=2)
    with pytest.raises(BatchError, match=r"microbatch.*\[1, 8\] int64.*captured for \[1, 16\]"):
        pm4.train_step({k: v[:, :8] for k, v in _padded(1).items()})


def test_eval_turns_dropout_off_and_keeps_the_rng():
    model = _llama(dropout=0.3)
    ref = copy.deepcopy(model).eval()
    pm = fxmegatron.parallelize(model, None, _padded(0))
    rng = pm.graph_module.fxm_rng
    pm.eval()
    step = rng.step
    b = _padded(1)
    with torch.no_grad():
        a, c, want = pm(b).item(), pm(b).item(), ref(**b).loss.item()
    assert a == c and abs(a - want) <= 1e-5 * abs(want), (a, c, want)
    assert rng.step == step
    pm.train()
    with torch.no_grad():
        d, e = pm(b).item(), pm(b).item()
    assert d != e and rng.step == step + 2     # dropout on again, a new mask per step


def test_a_forward_returning_logits_is_refused():
    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(CaptureError, match=r"Logits.forward returned a tensor of shape \[2, 4\].*scalar"):
        fxmegatron.parallelize(Logits(), None, (torch.randn(2, 4),))


def different_batches(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = fxmegatron.parallelize(_llama(), mesh, _padded(0))
    pm(_padded(5)).backward()                     # the same batch on both ranks: fine
    try:
        pm(_padded(10 + rank))                    # the loader used the global rank
    except BatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_tensor_parallel_ranks_given_different_batches_are_named():
    msgs = run_distributed(different_batches, 2)
    for m in msgs:
        assert "tp ranks [0, 1] must all be given the same batch" in m and "[1]" in m, m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_process_on_a_gpu_trains_where_the_model_is():
    model = _llama().cuda().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    pm = fxmegatron.parallelize(model, None, {k: v.cuda() for k, v in _padded(0).items()})
    assert all(p.is_cuda for p in pm.parameters())
    opt, opt_ref = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        b = {k: v.cuda() for k, v in _padded(step).items()}
        loss, loss_ref = pm(b), ref(**b).loss
        loss.backward()
        loss_ref.backward()
        assert abs(loss.item() - loss_ref.item()) <= 2e-2 * abs(loss_ref.item()), (step, loss, loss_ref)
        opt.step(); opt.zero_grad()
        opt_ref.step(); opt_ref.zero_grad()
