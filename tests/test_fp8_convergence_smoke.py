"""benchmarks/fp8_convergence.py on CPU (--tiny, FP8 emulated): bf16 and fp8-tensorwise train
from the same weights on the same batches, the CSV and summary hold what the H200 run's will,
and --plot draws a PNG from the CSV alone. Also its data: the Markov text is the same bytes for
the same seed, and every transition in it is one the source text has."""
import csv
import importlib.util
import json
import math
import os

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "fp8_convergence.py")
STEPS = 20


def load():
    spec = importlib.util.spec_from_file_location("fp8_convergence", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    fc = load()
    root = tmp_path_factory.mktemp("fp8_convergence")
    argv = ["--tiny", "--device", "cpu", "--steps", str(STEPS), "--precisions", "bf16,fp8-tensorwise",
            "--out", str(root / "run"), "--data-cache", str(root / "data.txt")]
    with pytest.MonkeyPatch.context() as mp:
        # the script's CPU path (torch ops), as a user runs it: conftest's interpreter would run the
        # fused cross-entropy's Triton kernel instead, ten times slower
        mp.delenv("TRITON_INTERPRET", raising=False)
        assert fc.main(argv) == 0
    return fc, fc.parse_args(argv), root


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_has_every_step_and_training_lowers_the_loss(tiny_run):
    fc, args, root = tiny_run
    rows = read_rows(root / "run" / "convergence.csv")
    assert list(rows[0]) == ["step", "precision", "train_loss", "val_loss"]
    assert len(rows) == 2 * STEPS
    for name in ("bf16", "fp8-tensorwise"):
        mine = [r for r in rows if r["precision"] == name]
        assert [int(r["step"]) for r in mine] == list(range(STEPS))
        train = [float(r["train_loss"]) for r in mine]
        val = {int(r["step"]): float(r["val_loss"]) for r in mine if r["val_loss"]}
        assert sorted(val) == [4, 9, 14, 19]            # every --val-every (5) steps, and the last
        assert all(math.isfinite(x) for x in train + list(val.values()))
        assert abs(train[0] - math.log(256)) < 0.05      # a fresh model: about uniform over bytes
        assert np.mean(train[-5:]) < train[0] - 0.3, train
        assert val[19] < val[4] - 0.1, val
    bf16, fp8 = ([float(r["train_loss"]) for r in rows if r["precision"] == n] for n in ("bf16", "fp8-tensorwise"))
    assert fp8[0] == pytest.approx(bf16[0], rel=5e-2)     # same weights, same batch: FP8 rounding only
    assert fp8[0] != bf16[0]                              # ... but FP8 did run


def test_every_run_starts_from_the_same_weights_and_batches(tiny_run):
    """Step 0's bf16 loss is the plain model's, in eager, with the script's initial weights on
    its first batch: parallelize(state_dict=...) took the weights, and the batch order is fixed."""
    fc, args, root = tiny_run
    from fxmegatron.models.gpt import GPT
    batches, _ = fc.datasets(args, str(root / "data.txt"))
    model = GPT(fc.model_config(args))
    model.load_state_dict(fc.initial_state(args))
    with torch.no_grad():
        want = model(*fc.to_batch(batches.windows(0), "cpu")).item()
    rows = read_rows(root / "run" / "convergence.csv")
    assert float(rows[0]["train_loss"]) == pytest.approx(want, rel=1e-5)


def test_summary_compares_fp8_with_bf16(tiny_run):
    fc, args, root = tiny_run
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert set(summary["runs"]) == {"bf16", "fp8-tensorwise"}
    for r in summary["runs"].values():
        assert math.isfinite(r["train_loss_last"]) and math.isfinite(r["val_loss_final"])
    d = summary["vs_bf16"]["fp8-tensorwise"]
    assert 0 < d["train_rel_diff"] < 1e-2 and 0 <= d["val_rel_diff"] < 1e-2 and d["within_tolerance"]
    assert summary["params"] == sum(p.numel() for p in fc.initial_state(args).values()) - 256 * args.hidden
    assert 0.3 < summary["data"]["entropy_floor"] < 0.45 and len(summary["data"]["sha256"]) == 64


def test_plot_writes_a_png(tiny_run):
    pytest.importorskip("matplotlib")
    fc, args, root = tiny_run
    png = root / "plot" / "fp8.png"
    assert fc.main(["--plot", str(root / "run" / "convergence.csv"), "--png", str(png)]) == 0
    data = png.read_bytes()
    assert len(data) > 10_000 and data.startswith(b"\x89PNG\r\n\x1a\n")


def test_markov_text_is_deterministic_and_follows_the_source():
    fc = load()
    src = np.fromfile(fc.SOURCE, np.uint8)
    a = fc.markov_bytes(src, 5, 40_000, seed=3, chains=8)
    assert np.array_equal(a, fc.markov_bytes(src, 5, 40_000, seed=3, chains=8))
    assert not np.array_equal(a, fc.markov_bytes(src, 5, 40_000, seed=4, chains=8))
    text = bytes(src) + bytes(src[:5])                    # the chain reads the source cyclically
    seen = {text[i:i + 6] for i in range(len(src))}
    for chain in a.reshape(8, -1):                        # chains are laid end to end
        grams = {bytes(chain[i:i + 6]) for i in range(len(chain) - 5)}
        assert grams <= seen


def test_byte_pair_tokens_are_the_text_read_two_bytes_a_token(tmp_path):
    """--token-bytes 2: token k is bytes 2k and 2k+1 of the text (high byte first), the model's
    vocabulary 65,536, and the held-out end is the text's end."""
    fc = load()
    path = tmp_path / "text.bin"
    raw = np.random.default_rng(0).integers(0, 256, 8000, dtype=np.uint8)
    raw.tofile(path)
    args = fc.parse_args(["--tiny", "--token-bytes", "2", "--seq", "7", "--batch", "2", "--val-batches", "1"])
    batches, val = fc.datasets(args, str(path))
    want = raw[0::2].astype(np.int64) * 256 + raw[1::2]
    stream = batches.stream
    assert len(stream) + round(len(want) * args.valid_fraction) == len(want)
    assert np.array_equal(stream.read(0, len(stream)), want[:len(stream)])
    assert fc.model_config(args).vocab_size == 65536 and int(want.max()) >= 256
