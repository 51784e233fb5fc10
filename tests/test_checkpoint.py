"""Sharded checkpoints (fxmegatron.io.checkpoint): resume is bitwise, a checkpoint saved at one
(dp, pp, tp) loads at another, saves are atomic, full_state_dict loads into the unmodified model."""
import json
import os

import pytest

from fxmegatron.io.checkpoint import CheckpointError, load
from tests.distributed import run_distributed
from tests.workers import ckpt_run, full_state_roundtrip

SAVE_LAYOUT = (1, 2, 2)


@pytest.fixture(scope="module")
def straight():
    """Six steps without interruption at (1, 2, 2)."""
    return run_distributed(ckpt_run, 4, SAVE_LAYOUT, 6)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt") / "step3")
    losses = run_distributed(ckpt_run, 4, SAVE_LAYOUT, 3, 0, None, d)[0]
    return d, losses


def test_save_is_complete_and_sharded(saved):
    d, _ = saved
    index = json.load(open(os.path.join(d, "index.json")))
    assert index["layout"] == {"dp": 1, "pp": 2, "tp": 2}
    assert sorted(index["files"]) == sorted(f"shard-pp{p}-tp{t}.safetensors" for p in range(2) for t in range(2))
    assert index["extra"] == {"step": 3}
    assert not os.path.exists(d + ".tmp")


def test_resume_is_bitwise(straight, saved):
    d, first = saved
    second = run_distributed(ckpt_run, 4, SAVE_LAYOUT, 3, 3, d)[0]
    assert first + second == straight          # exact float equality


def _as_tp_only_form(src: str, dst: str) -> None:
    """Rewrite a checkpoint's pieces in the form written before per-axis layouts: tp's
    placement, the writer's tp rank and tp's degree ({"placement", "tp_rank", "tp"}; every tp
    rank listed a replicated tensor under its own rank), the index's digests updated."""
    import hashlib
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    shutil.copytree(src, dst)
    index = json.load(open(os.path.join(dst, "index.json")))
    tp = index["layout"]["tp"]
    for fname in index["files"]:
        path = os.path.join(dst, fname)
        with safe_open(path, "pt") as f:
            meta, tensors = json.loads(f.metadata()["fxmegatron"]), {k: f.get_tensor(k) for k in f.keys()}
        rank = int(fname.split("-tp")[1].split(".")[0])
        old = {}
        for key, m in meta.items():
            assert set(m) == {"layout", "coords", "degrees", "shape"}, m
            if "tp" in m["layout"]:
                old[key] = {"placement": m["layout"]["tp"], "tp_rank": m["coords"]["tp"], "tp": m["degrees"]["tp"],
                            "shape": m["shape"]}
            elif m["shape"] == list(tensors[key].shape) and tensors[key].dim() > 0:
                old[key] = {"placement": "R", "tp_rank": rank, "tp": tp, "shape": m["shape"]}
            else:
                old[key] = {"placement": "R", "tp_rank": 0, "tp": 1, "shape": m["shape"]}
        save_file(tensors, path, metadata={"fxmegatron": json.dumps(old)})
        with open(path, "rb") as f:
            index["digests"][fname] = {"sha256": hashlib.file_digest(f, "sha256").hexdigest(),
                                       "bytes": os.path.getsize(path)}
    json.dump(index, open(os.path.join(dst, "index.json"), "w"))


def test_a_checkpoint_of_the_tp_only_form_resumes_bitwise_and_reshards(straight, saved, tmp_path):
    d, first = saved
    old = str(tmp_path / "old")
    _as_tp_only_form(d, old)
    assert run_distributed(ckpt_run, 4, SAVE_LAYOUT, 3, 3, old)[0] == straight[3:]
    nxt = run_distributed(ckpt_run, 4, (1, 1, 4), 1, 3, old)[0]
    assert abs(nxt[0] - straight[3]) <= 1e-5 * abs(straight[3]), (nxt, straight)


@pytest.mark.parametrize("layout", [(1, 1, 4), (2, 2, 1)], ids=["dp1-pp1-tp4", "dp2-pp2-tp1"])
def test_reshard(straight, saved, layout):
    d, _ = saved
    world = layout[0] * layout[1] * layout[2]
    nxt = run_distributed(ckpt_run, world, layout, 1, 3, d)[0]
    assert abs(nxt[0] - straight[3]) <= 1e-5 * abs(straight[3]), (nxt, straight)


def test_resume_with_dropout_is_bitwise(tmp_path):
    d = str(tmp_path / "ck")
    straight = run_distributed(ckpt_run, 2, (1, 1, 2), 4, 0, None, None, 0.1)[0]
    a = run_distributed(ckpt_run, 2, (1, 1, 2), 2, 0, None, d, 0.1)[0]
    b = run_distributed(ckpt_run, 2, (1, 1, 2), 2, 2, d, None, 0.1)[0]
    assert a + b == straight


def test_resume_with_fused_adamw_is_bitwise(tmp_path):
    """FusedAdamW's fp32 masters, moments, step counts and both parameter groups' rates (a
    LambdaLR schedule, its own state in ``extra``) go into the checkpoint and come back."""
    d = str(tmp_path / "ck")
    straight = run_distributed(ckpt_run, 2, (1, 1, 2), 4, 0, None, None, 0.0, "gpt", 2, True)[0]
    a = run_distributed(ckpt_run, 2, (1, 1, 2), 2, 0, None, d, 0.0, "gpt", 2, True)[0]
    b = run_distributed(ckpt_run, 2, (1, 1, 2), 2, 2, d, None, 0.0, "gpt", 2, True)[0]
    assert a + b == straight
    index = json.load(open(os.path.join(d, "index.json")))
    for g in index["param_groups"]:
        assert g["initial_lr"] == 1e-3 and abs(g["lr"] - 1e-3 / 3) < 1e-12
    assert [g["weight_decay"] for g in index["param_groups"]] == [1e-2, 0.0]


def test_unfinished_save_is_refused(tmp_path, saved):
    d, _ = saved
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            (partial / f).write_bytes(open(os.path.join(d, f), "rb").read())
    with pytest.raises(CheckpointError, match="no index.json"):
        load(None, None, str(partial))


@pytest.mark.parametrize("name,layout", [("gpt", (1, 2, 2)), ("gpt2", (1, 2, 2)), ("llama", (2, 1, 2))])
def test_full_state_dict_loads_into_unmodified_model(name, layout, tmp_path):
    world = layout[0] * layout[1] * layout[2]
    res = run_distributed(full_state_roundtrip, world, layout, name, str(tmp_path / "hf"))[0]
    assert res["n"] > 0
    assert abs(res["loss_loaded"] - res["loss_parallel"]) <= 1e-5 * abs(res["loss_parallel"]), res
    if "loss_roundtrip" in res:
        assert res["equal"] and res["loss_roundtrip"] == res["loss_loaded"]
