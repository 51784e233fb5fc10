"""``layout.ep = 2`` in the trainer: a tiny Hugging Face Mixtral folder written by
``save_pretrained`` (experts saved one tensor each) fine-tuned on 2 gloo processes (torchrun,
dp 2 folded into ep 2: each rank holds 2 of the 4 experts of each block) has the one-process
run's loss at every step and its validation loss (1e-5), the same weights after the run (1e-5),
and a per-step ``moe_imbalance`` in loss.csv equal to the one computed from the routers of the
model in memory on that step's batch; ``fxmegatron export`` of the ep checkpoint is a folder
``MixtralForCausalLM.from_pretrained`` loads, holding exactly the checkpoint's tensors, with
the run's validation loss."""
import os

import numpy as np
import pytest
import torch

from tests.trainer_runs import rows, train, write_config

pytestmark = pytest.mark.slow

STEPS = 3
E, K = 4, 2


def save_mixtral(path):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K, intermediate_size=32,
                        output_router_logits=False, router_jitter_noise=0.0, max_position_embeddings=64,
                        pad_token_id=1, bos_token_id=0, eos_token_id=0)
    model = MixtralForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def imbalance(model, batch):
    """max over layers of (rows of the busiest expert / mean rows per expert) over the batch, from
    the routers of the model in memory (top-k of the router logits)."""
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], output_router_logits=True)
    worst = 0.0
    for logits in out.router_logits:
        counts = torch.bincount(torch.topk(logits, K, dim=-1).indices.flatten(), minlength=E).double()
        assert counts.sum() == batch["input_ids"].numel() * K
        worst = max(worst, (counts.max() / counts.mean()).item())
    return worst


def test_ep2_finetunes_as_one_process_and_exports(tmp_path):
    from transformers import MixtralForCausalLM

    from fxmegatron.io.checkpoint import read_full_state
    from fxmegatron.train.config import load as load_config
    from fxmegatron.train.export import main as export_main
    from fxmegatron.train.setup import prepare

    original = save_mixtral(tmp_path / "mixtral")
    rng = np.random.default_rng(0)
    (rng.zipf(1.5, 4000) % 128).astype(np.uint16).tofile(tmp_path / "train.bin")

    def run(name, nproc, layout):
        cfg = write_config(tmp_path / f"{name}.toml", {
            "run": {"out": str(tmp_path / name), "steps": STEPS, "seed": 0, "log_every": 1},
            "model": {"kind": "hf", "path": str(tmp_path / "mixtral")},
            "data": {"kind": "tokens", "train": str(tmp_path / "train.bin"), "token_dtype": "uint16",
                     "seq_len": 16, "global_batch": 4},
            "layout": layout,
            "optim": {"lr": 1e-2, "warmup_steps": 1},
            "eval": {"batches": 1},
            "checkpoint": {"every": 1, "keep": STEPS, "resume": "none"},
            "log": {"plot": False, "tensorboard": False},
        })
        r = train(cfg, nproc)
        assert r.returncode == 0, r.stdout
        rs = rows(tmp_path / name)
        assert [int(x["step"]) for x in rs] == list(range(1, STEPS + 1)), rs
        return cfg, r.stdout, rs

    _, _, ref = run("one", 1, {})
    cfg, log, got = run("ep2", 2, {"dp": 2, "ep": 2})
    assert "dp=2 pp=1 tp=1 ep=2" in log, log
    for key in ("loss", "val_loss"):
        a = [float(x[key]) for x in got if x[key]]
        b = [float(x[key]) for x in ref if x[key]]
        assert len(a) == len(b) == (STEPS if key == "loss" else 1), (key, got, ref)
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-5 * abs(y), (key, a, b)

    # the weights after the run: the one-process run's (an expert updated on the wrong rows, or not
    # at all, would be off by about the learning rate)
    ckpt = tmp_path / "ep2" / "checkpoints" / f"step-{STEPS:08d}"
    trained = read_full_state(str(ckpt))
    alone = read_full_state(str(tmp_path / "one" / "checkpoints" / f"step-{STEPS:08d}"))
    assert sorted(trained) == sorted(alone) == sorted(original.state_dict())
    for k, v in alone.items():
        assert (trained[k] - v).abs().max().item() <= 1e-5, k

    # the load figure: none at ep 1; at ep 2 each step's, from the routers of the weights that step
    # started from (the folder, then the checkpoints of steps 1 and 2) on that step's global batch
    assert all(x["moe_imbalance"] == "" for x in ref)
    prep = prepare(load_config(str(cfg)), None)
    figures = []
    for step in range(STEPS):
        model = MixtralForCausalLM.from_pretrained(str(tmp_path / "mixtral"), torch_dtype=torch.float32)
        if step:
            model.load_state_dict(read_full_state(str(tmp_path / "ep2" / "checkpoints" / f"step-{step:08d}")))
        model.train(False)
        figures.append(imbalance(model, prep.batch(prep.train.windows(step), "cpu")))
    logged = [float(x["moe_imbalance"]) for x in got]
    assert all(1.0 <= f <= E / K for f in figures)
    assert logged == pytest.approx(figures, rel=1e-12, abs=0), (logged, figures)
    assert "MoE imbalance" in log

    # exported back: from_pretrained loads it, every tensor the checkpoint's, the run's validation loss
    dest = tmp_path / "exported"
    assert export_main([str(ckpt), str(dest)]) == 0
    back = MixtralForCausalLM.from_pretrained(str(dest), local_files_only=True, torch_dtype=torch.float32)
    sd = back.state_dict()
    assert sorted(sd) == sorted(trained)
    for k, v in trained.items():
        assert sd[k].shape == v.shape and (sd[k] - v).abs().max().item() <= 1e-5, k
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert sd[name].shape[0] == E and not torch.allclose(sd[name], original.state_dict()[name], atol=1e-4)
    back.train(False)
    with torch.no_grad():
        val = np.mean([back(**prep.batch(w, "cpu")).loss.item() for w in prep.valid[:1]])
    want = float(got[-1]["val_loss"])
    assert abs(val - want) <= 1e-5 * abs(want), (val, want)
    assert os.path.exists(dest / "config.json")
