"""The trainer's config: every mistake is one ConfigError naming the key, before any process group
work; the learning-rate schedules; docs/TRAINER.md lists every key."""
import math
import os

import pytest

from fxmegatron.errors import ConfigError
from fxmegatron.train import config, config_checks
from fxmegatron.train.lr import lr_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "data", "tiny.txt")


def base(**sections):
    raw = {"run": {"steps": 3}, "data": {"train": TINY, "seq_len": 16, "global_batch": 4}}
    for s, d in sections.items():
        raw.setdefault(s, {}).update(d)
    return raw


def check(raw, world=1):
    cfg = config.from_dict(raw, "t.toml", ROOT)
    config_checks.check_world(cfg, world)
    config_checks.check_files(cfg)
    return cfg


def test_defaults_and_paths():
    cfg = check(base(layout={"tp": 2}), world=2)
    assert cfg.layout.tp == 2 and cfg.layout.dp == 1 and cfg.optim.decay == "cosine"
    assert cfg.data.train == [TINY]
    assert cfg.checkpoint.dir == os.path.join(ROOT, "runs", "train", "checkpoints")
    assert isinstance(cfg.optim.lr, float)
    cfg = check(base(layout={"cp": 2, "dp": 2}), world=4)       # seq_len 16 = 4 chunks of 4
    assert cfg.layout.cp == 2 and cfg.layout.cp_attention == "ring"


@pytest.mark.parametrize("raw, message", [
    (base(layout={"tpp": 2}), "unknown key layout.tpp (did you mean 'tp'?)"),
    (base(optimizer={"lr": 1.0}), "unknown section [optimizer] (did you mean 'optim'?)"),
    (base(layout={"tp": "2"}), "layout.tp = '2' must be int"),
    (base(layout={"sequence_parallel": 1}), "layout.sequence_parallel = 1 must be bool"),
    (base(layout={"tp": True}), "layout.tp = True must be int"),
    (base(layout={"recompute": "al"}), "layout.recompute = 'al' is not one of"),
    (base(optim={"lr": -1.0}), "optim.lr = -1.0 must be >= 0"),
    ({"data": {"train": TINY, "seq_len": 16, "global_batch": 4}}, "run.steps is required"),
    (base(layout={"cp": 0}), "layout.cp = 0 must be >= 1"),
    (base(layout={"cp": 2, "cp_attention": "p2p"}), "layout.cp_attention = 'p2p' is not one of"),
    (base(data={"train": [TINY, 3]}), "data.train must be a path or a list of paths"),
    (base(layout={"compile": "fast"}), "layout.compile = 'fast' is not one of False, True, 'default', "
                                       "'reduce-overhead'"),
    (base(layout={"compile": 1}), "layout.compile = 1 must be bool or str"),
])
def test_bad_keys_name_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        check(raw)
    assert message in str(e.value), str(e.value)
    assert "t.toml" in str(e.value)


@pytest.mark.parametrize("raw, world, message", [
    (base(layout={"tp": 2, "pp": 2}), 2, "layout dp 1 x pp 2 x cp 1 x tp 2 = 4, but 2 processes were started"),
    (base(layout={"dp": 2, "microbatches": 4}), 2, "data.global_batch 4 must be divisible by layout.dp 2 x "
                                                   "layout.microbatches 4 = 8"),
    (base(layout={"sequence_parallel": True}), 1, "sequence_parallel needs layout.tp > 1"),
    (base(data={"train": "missing.txt"}), 1, "data file " + os.path.join(ROOT, "missing.txt") + " does not exist"),
    (base(model={"kind": "hf", "path": "nowhere"}), 1, "has no config.json"),
    (base(data={"tokenizer": "no_tokenizer_dir"}), 1, "is not a directory"),
    (base(layout={"fuse": True, "compile": True}), 1, "alternatives"),
    (base(layout={"cp": 3}), 3, "data.seq_len 16 must be divisible by 2 x layout.cp 3 = 6"),
])
def test_bad_layouts_and_files(raw, world, message):
    with pytest.raises(ConfigError) as e:
        check(raw, world)
    assert message in str(e.value), str(e.value)


def test_compile_takes_torch_compile_s_modes(tmp_path):
    import torch._inductor
    from fxmegatron.train.loop import layout_line
    from fxmegatron.train.setup import layout_of
    modes = set(torch._inductor.list_mode_options())
    assert {c for c in config.COMPILE_CHOICES if isinstance(c, str)} <= modes, modes
    cfg = check(base(layout={"compile": "reduce-overhead", "tp": 2}), world=2)
    assert layout_of(cfg).compile == "reduce-overhead"
    assert layout_line(cfg).endswith(", compile=reduce-overhead"), layout_line(cfg)
    assert layout_line(check(base(layout={"compile": True}))).endswith(", compile")
    p = tmp_path / "c.toml"
    p.write_text(f'[run]\nsteps = 3\n[data]\ntrain = "{TINY}"\nseq_len = 16\nglobal_batch = 4\n')
    assert config.load(str(p), ["layout.compile=max-autotune"]).layout.compile == "max-autotune"
    assert config.load(str(p), ["layout.compile=true"]).layout.compile is True


def test_overrides_and_toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(f'[run]\nsteps = 3\n[data]\ntrain = "{TINY}"\nseq_len = 16\nglobal_batch = 4\n')
    cfg = config.load(str(p), ["layout.tp=2", "run.out=elsewhere", "layout.recompute=full"])
    assert cfg.layout.tp == 2 and cfg.layout.recompute == "full"
    assert cfg.run.out == str(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="unknown key layout.tq"):
        config.load(str(p), ["layout.tq=2"])
    p.write_text("[run\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(str(p))
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(str(tmp_path / "none.toml"))


def test_docs_list_every_key():
    with open(os.path.join(ROOT, "docs", "TRAINER.md")) as f:
        doc = f.read()
    missing = [k.path for k in config.KEYS if f"`{k.path}`" not in doc]
    assert not missing, f"docs/TRAINER.md does not describe {missing}"
    table = doc.split("<!-- keys: written by fxmegatron.train.config.markdown() -->\n")[1].split("<!-- /keys -->")[0]
    assert table == config.markdown(), "docs/TRAINER.md's key table is out of date: rewrite it from config.markdown()"


# configs whose model and data a step of the README writes first (tests/test_readme_walkthrough.py runs them)
WRITTEN_FIRST = {"hf_chat_tiny.toml"}


def test_example_configs_are_valid():
    folder = os.path.join(ROOT, "examples", "configs")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".toml"):
            cfg = config.load(os.path.join(folder, name))
            if name not in WRITTEN_FIRST:
                config_checks.check_files(cfg)


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant", "wsd"])
def test_lr_schedules(decay):
    steps, lr, min_lr, warm = 100, 1.0, 0.1, 10
    rates = [lr_at(s, steps, lr, min_lr, warm, decay, 0.2) for s in range(steps)]
    assert rates[0] == pytest.approx(0.1) and rates[warm - 1] == pytest.approx(1.0)
    assert all(a <= b + 1e-12 for a, b in zip(rates[:warm], rates[1:warm]))          # warmup rises
    after = rates[warm:]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))                       # then never rises
    if decay == "constant":
        assert set(after) == {1.0}
    else:
        assert rates[-1] == pytest.approx(min_lr)
    if decay == "cosine":
        mid = warm + (steps - 1 - warm) // 2
        assert rates[mid] == pytest.approx(min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * 0.5)), abs=0.02)
    if decay == "wsd":
        assert rates[79] == 1.0 and rates[80] < 1.0
