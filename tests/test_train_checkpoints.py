"""The trainer's checkpoint folders: ``resume = "auto"`` takes the latest complete one and says which
step folders it passed over and why (an unfinished save must not read as "nothing to resume")."""
import os

import pytest

from fxmegatron.train.checkpoints import resume_from
from tests.trainer_runs import TINY, rows, train, write_config


def folder(root, name, index):
    os.makedirs(root / name)
    (root / name / "shard-pp0-tp0.safetensors").write_bytes(b"")
    if index:
        (root / name / "index.json").write_text("{}")


def test_auto_names_the_folders_it_skips(tmp_path, capsys):
    folder(tmp_path, "step-00000002", index=True)
    folder(tmp_path, "step-00000004.tmp", index=False)
    folder(tmp_path, "step-00000006", index=False)
    assert resume_from(str(tmp_path), "auto") == str(tmp_path / "step-00000002")
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    assert (f'checkpoint.resume = "auto" skipped {tmp_path / "step-00000004.tmp"} (a save cut off before its '
            f'index.json); {tmp_path / "step-00000006"} (no index.json); resuming from '
            f'{tmp_path / "step-00000002"}') in out


def test_auto_says_it_starts_afresh_when_the_only_checkpoint_is_incomplete(tmp_path, capsys):
    folder(tmp_path, "step-00000004.tmp", index=False)
    folder(tmp_path, "step-00000008.tmp", index=True)
    assert resume_from(str(tmp_path), "auto") is None
    out = capsys.readouterr().out
    assert f"{tmp_path / 'step-00000004.tmp'} (a save cut off before its index.json)" in out
    assert (f"{tmp_path / 'step-00000008.tmp'} (complete but never renamed; rename it to step-00000008 to resume "
            "from it); no complete checkpoint: starting from step 0") in out


def test_auto_is_quiet_when_nothing_was_skipped(tmp_path, capsys):
    assert resume_from(str(tmp_path / "none yet"), "auto") is None
    folder(tmp_path, "step-00000002", index=True)
    assert resume_from(str(tmp_path), "auto") == str(tmp_path / "step-00000002")
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_resume_that_does_not_fit_is_one_line_before_any_step(tmp_path):
    """As a user meets them (torchrun, one process): a checkpoint of another model, a shard with a
    flipped bit, and an only checkpoint that never finished."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(out), "steps": 2},
        "model": {"kind": "gpt", "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 16}},
        "data": {"train": TINY, "seq_len": 16, "global_batch": 4},
        "log": {"plot": False, "tensorboard": False},
    })
    assert train(cfg, 1).returncode == 0
    ckpt = out / "checkpoints" / "step-00000002"

    def refused(*args):
        r = train(cfg, 1, "--set", "run.steps=4", *args)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("fxmegatron:")]
        assert r.returncode != 0 and len(lines) == 1, r.stdout
        assert len(rows(out)) == 2, "a step ran"
        return lines[0]
    # one layer fewer: the old load took the layers the model has and trained on
    assert f"before its first step: CheckpointError: {ckpt}: a checkpoint of another model: parameter 'blocks.1." \
           in refused("--set", "model.gpt.n_layer=1")
    shard = ckpt / "shard-pp0-tp0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    assert f"CheckpointError: {shard}: sha256 " in refused()
    os.rename(ckpt, str(ckpt) + ".tmp")
    os.remove(os.path.join(str(ckpt) + ".tmp", "index.json"))
    r = train(cfg, 1, "--set", "run.steps=3")
    assert r.returncode == 0, r.stdout
    assert (f'checkpoint.resume = "auto" skipped {ckpt}.tmp (a save cut off before its index.json); no complete '
            "checkpoint: starting from step 0") in r.stdout
    assert [int(x["step"]) for x in rows(out)] == [1, 2, 3]
