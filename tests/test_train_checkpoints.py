"""The trainer's checkpoint folders: ``resume = "auto"`` takes the latest complete one and says which
step folders it passed over and why (an unfinished save must not read as "nothing to resume")."""
import os

from fxmegatron.train.checkpoints import resume_from


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
