"""Bad trainer configs end with one error line on stderr (exit status 2) before any process group work:
an unknown key, a layout that does not match the world size, a missing data file, a tokenizer or token
file that does not fit the model's vocabulary."""
import os

import numpy as np
import pytest
import torch.distributed as dist

from tests.trainer_runs import TINY, tiny_tokenizer, train, write_config
from fxmegatron.train.main import main


def run_main(monkeypatch, capsys, cfg, world=1):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")      # nothing listens there: group work would fail loudly
    capsys.readouterr()         # what the test's own set-up printed
    code = main([str(cfg)])
    err = capsys.readouterr().err
    assert not dist.is_initialized()
    return code, err


def base(tmp_path, **sections):
    raw = {"run": {"out": str(tmp_path / "out"), "steps": 2},
           "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
           "data": {"train": TINY, "seq_len": 16, "global_batch": 4}}
    for s, d in sections.items():
        raw.setdefault(s, {}).update(d)
    return raw


def one_line(err, *parts):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("fxmegatron train: error: "), err
    for p in parts:
        assert p in lines[0], (p, lines[0])


def test_unknown_key(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, optim={"learning_rate": 1e-3}))
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, "c.toml", "unknown key optim.learning_rate")


def test_unknown_gpt_field(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, model={"gpt": {"n_layers": 2}}))
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, "unknown key model.gpt.n_layers")


def test_layout_does_not_match_world(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, layout={"tp": 2, "pp": 2}))
    code, err = run_main(monkeypatch, capsys, cfg, world=2)
    assert code == 2
    one_line(err, "dp 1 x pp 2 x cp 1 x tp 2 = 4, but 2 processes were started")


def test_missing_data_file(tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, data={"train": str(tmp_path / "nope.txt")}))
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, f"data file {tmp_path / 'nope.txt'} does not exist")


def test_tokens_outside_the_models_vocabulary(tmp_path, monkeypatch, capsys):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, data={"kind": "tokens", "train": str(tmp_path / "t.bin")},
                                                model={"gpt": {"vocab_size": 500}}))
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, "t.bin holds token ids up to 999", "vocabulary has 500",
             'no t.bin.json records its dtype: if the file holds uint32 ids, set data.token_dtype = "uint32"')


def test_uint32_tokens_read_as_uint16(tmp_path, monkeypatch, capsys):
    """The default token_dtype on a uint32 file: ids all inside the vocabulary, every second one 0."""
    path = tmp_path / "t.bin"
    (np.arange(4000) % 200).astype(np.uint32).tofile(path)
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, data={"kind": "tokens", "train": str(path)},
                                                model={"gpt": {"vocab_size": 256}}))
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, f"{path}: read as uint16", 'set data.token_dtype = "uint32"')


def test_tokenizer_larger_than_the_models_vocabulary(tmp_path, monkeypatch, capsys):
    from tests.families import FAMILIES
    model_dir = tmp_path / "llama"
    FAMILIES["llama"].build(n_layer=1).save_pretrained(model_dir)        # vocabulary 128
    tok_dir = tiny_tokenizer(tmp_path / "tok", vocab=300)
    cfg = write_config(tmp_path / "c.toml", {**base(tmp_path, data={"tokenizer": str(tok_dir)}),
                                              "model": {"kind": "hf", "path": str(model_dir)}})
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, f"the tokenizer {tok_dir} has", "the model's vocabulary has 128")


@pytest.mark.slow
def test_under_torchrun_one_line(tmp_path):
    """As a user sees it: torchrun, 2 processes, a layout for 4. Local rank 0, the one that prints,
    is made the slowest to start (a sitecustomize sleeps in it): the other, failing first, must not
    end the job before the line is out (torchrun ends every worker once one has failed)."""
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, layout={"tp": 4}))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('LOCAL_RANK') == '0':\n    time.sleep(3)\n")
    r = train(cfg, 2, timeout=120, extra_env={"PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode != 0
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("fxmegatron train: error:")]
    assert errors == [f"fxmegatron train: error: {cfg}: layout dp 1 x pp 1 x cp 1 x tp 4 = 4, but 2 processes "
                      "were started (torchrun --nproc_per_node): they must be equal"], r.stdout
    assert not os.path.exists(tmp_path / "out" / "loss.csv")


def test_truncated_model_weights(tmp_path, monkeypatch, capsys):
    from tests.families import FAMILIES
    model_dir = tmp_path / "llama"
    FAMILIES["llama"].build(n_layer=1).save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    cfg = write_config(tmp_path / "c.toml", {**base(tmp_path), "model": {"kind": "hf", "path": str(model_dir)}})
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, f"{weights}: not a readable safetensors file")


def test_data_shorter_than_one_batch(tmp_path, monkeypatch, capsys):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    cfg = write_config(tmp_path / "c.toml", base(tmp_path, data={"kind": "tokens", "train": str(tmp_path / "t.bin"),
                                                                 "global_batch": 8}))
    code, err = run_main(monkeypatch, capsys, cfg)
    assert code == 2
    one_line(err, f"{tmp_path / 't.bin'}", "fewer than global_batch = 8")
