"""``data.mix``: a weighted mixture of corpora, blended as Megatron's ``BlendedDataset``. Checked
against a hand-computed composition and Megatron's ``build_blending_indices`` rewritten here
line for line, each corpus's windows against its own epoch permutations drawn here from numpy,
resumability (any step computed fresh equals the one drawn in sequence), the checkpoint state
that refuses another mixture, the held-out rule, the config's errors, and a trainer run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fxmegatron.errors import ConfigError, DataError
from fxmegatron.train.data import Batches
from fxmegatron.train.mixture import Mixture, blend, eval_mix_windows
from fxmegatron.train.tokens import TokenStream, split_stream
from tests.trainer_runs import TINY, rows, train, write_config

SEQ = 4
# corpus 0: 41 tokens, 10 windows; corpus 1: 13 tokens, 3 windows, negative ids (a masked label
# is stored as ~id): nothing may assume a window is non-negative
A = np.arange(41, dtype=np.int64)
B = -1 - np.arange(13, dtype=np.int64)


def _corpora():
    return [TokenStream(A.copy(), name="a"), TokenStream(B.copy(), name="b")]


def megatron_blending(weights, size):
    """megatron/core/datasets/helpers.cpp build_blending_indices, in Python."""
    current = [0] * len(weights)
    index, sample_index = [], []
    for sample_idx in range(size):
        x = max(float(sample_idx), 1.0)
        max_error_index, max_error = 0, weights[0] * x - current[0]
        for d in range(1, len(weights)):
            error = weights[d] * x - current[d]
            if error > max_error:
                max_error, max_error_index = error, d
        index.append(max_error_index)
        sample_index.append(current[max_error_index])
        current[max_error_index] += 1
    return index, sample_index


def window(tokens, seed, corpus, position):
    """Corpus ``corpus``'s window at ``position`` of its epochs, drawn here from numpy alone."""
    n = (len(tokens) - 1) // SEQ
    s = int(np.random.SeedSequence([seed, corpus]).generate_state(1, np.uint64)[0])
    w = int(np.random.Generator(np.random.PCG64([s, position // n])).permutation(n)[position % n])
    return tokens[w * SEQ:w * SEQ + SEQ + 1].tolist()


def test_the_composition_of_each_step_by_hand():
    """0.75 / 0.25, global batch 4. Errors w_i * max(n, 1) - count_i, ties to corpus 0:
    n=0: .75, .25 -> a; n=1: -.25, .25 -> b; n=2: .5, -.5 -> a; n=3: .25, -.25 -> a;
    n=4: 0, 0 -> a; n=5: -.25, .25 -> b; n=6, n=7 as n=2, n=3. Each step: a a a from a's
    positions 3k..3k+2 and b's position k, in the order a b a a."""
    m = Mixture(_corpora(), [0.75, 0.25], SEQ, 4, seed=5)
    for step in range(4):
        picks = m.picks(step)
        assert picks[:, 0].tolist() == [0, 1, 0, 0]
        want = [window(A, 5, 0, 3 * step), window(B, 5, 1, step), window(A, 5, 0, 3 * step + 1),
                window(A, 5, 0, 3 * step + 2)]
        assert m.windows(step).tolist() == want
    # b's 3 windows: each once in positions 0..2 (an epoch), in another order in 3..5
    b_rows = [tuple(m.windows(s)[1].tolist()) for s in range(6)]
    assert len(set(b_rows[:3])) == 3 and set(b_rows[:3]) == set(b_rows[3:]) and min(min(r) for r in b_rows) < 0


@pytest.mark.parametrize("weights", [[0.75, 0.25], [0.5, 0.3, 0.2], [3.0, 1.0, 1e-3, 7.5]])
def test_the_blending_is_megatrons(weights):
    w = [x / sum(weights) for x in weights]
    index, sample_index = megatron_blending(w, 3000)
    counts = [0] * len(w)
    assert blend(w, counts, 0, 3000) == index
    assert counts == [index.count(i) for i in range(len(w))]
    m = Mixture([TokenStream(A.copy(), name=str(i)) for i in range(len(w))], weights, SEQ, 6, seed=0)
    got = np.concatenate([m.picks(s) for s in range(500)])
    assert got[:, 0].tolist() == index
    for i in range(len(w)):      # each corpus's k-th sample is position k of its own epochs
        pos = [p for c, p in zip(index, sample_index) if c == i]
        assert got[got[:, 0] == i, 1].tolist() == [int(m.samplers[i].indices(p)[0]) for p in pos]
    # how far a corpus strays from its share: 1/2 with two corpora; with more, Megatron's rule
    # (its x = max(n, 1) counts samples 0 and 1 alike) can stray past 1 (1.32 for the third case)
    done, worst = np.zeros(len(w)), 0.0
    for n, c in enumerate(index, 1):
        done[c] += 1
        worst = max(worst, float(np.abs(done - np.array(w) * n).max()))
    assert worst <= (0.5 + 1e-9 if len(w) == 2 else 1.5), worst


def test_any_step_computed_fresh_equals_the_one_drawn_in_sequence():
    weights = [0.5, 0.3, 0.2]
    corpora = [TokenStream(A.copy(), name="a"), TokenStream(B.copy(), name="b"), TokenStream(A[::-1].copy(), name="c")]
    seq = Mixture(corpora, weights, SEQ, 4, seed=9)
    drawn = {s: seq.picks(s) for s in range(2100)}            # 8400 samples: past two memo marks
    assert np.array_equal(seq.windows(2099), Mixture(corpora, weights, SEQ, 4, seed=9).windows(2099))
    jumpy = Mixture(corpora, weights, SEQ, 4, seed=9)
    for s in (2050, 7, 1100, 0, 2099, 1024, 1025, 3):          # out of order, on one object
        assert np.array_equal(jumpy.picks(s), drawn[s]), s
    other = Mixture(corpora, weights, SEQ, 4, seed=10)          # another seed: the same corpora, other windows
    assert any(not np.array_equal(other.picks(s), drawn[s]) for s in range(5))


def test_a_resume_with_other_weights_or_corpora_is_refused_naming_them():
    saved = json.loads(json.dumps(Mixture(_corpora(), [0.75, 0.25], SEQ, 4, seed=5).state()))
    Mixture(_corpora(), [3, 1], SEQ, 4, seed=5).check_state(saved)      # the same normalised weights: the same batches
    with pytest.raises(DataError, match=r"data.mix\[0\] \(a\): weight was 0.75 \(0.75 normalised\), is 0.7 "
                                        r"\(0.7 normalised\); data.mix\[1\] \(b\): weight was 0.25"):
        Mixture(_corpora(), [0.7, 0.3], SEQ, 4, seed=5).check_state(saved)
    edited = _corpora()
    edited[1] = TokenStream(np.where(B == -7, 99, B), name="b")
    with pytest.raises(DataError, match=r"data.mix\[1\] \(b\): .*stream content differs"):
        Mixture(edited, [0.75, 0.25], SEQ, 4, seed=5).check_state(saved)
    with pytest.raises(DataError, match=r"it mixed 2 corpora \['a', 'b'\], this run 3 \['a', 'b', 'a'\]"):
        Mixture(_corpora() + [TokenStream(A.copy(), name="a")], [3, 1, 1], SEQ, 4, seed=5).check_state(saved)
    with pytest.raises(DataError, match=r"seed was 5, is 6"):
        Mixture(_corpora(), [0.75, 0.25], SEQ, 4, seed=6).check_state(saved)
    single = Batches(TokenStream(A.copy(), name="a"), SEQ, 4, 5).state()
    with pytest.raises(DataError, match=r"trained on one corpus \(data.train: a\), this run mixes 2"):
        Mixture(_corpora(), [0.75, 0.25], SEQ, 4, seed=5).check_state(single)
    with pytest.raises(DataError, match=r"trained on a mixture of 2 corpora \(data.mix\), this run on one"):
        Batches(TokenStream(A.copy(), name="a"), SEQ, 4, 5).check_state(saved)


def test_held_out_tails_are_blended_like_training():
    """Without data.valid each corpus holds out its tail; eval sample k takes its corpus's next
    tail window in order, corpora chosen as training chooses them: a b a a | a b a a."""
    va, vb = TokenStream(A.copy(), name="va"), TokenStream(B.copy(), name="vb")
    got = eval_mix_windows([va, vb], [0.75, 0.25], SEQ, 4, 2)
    tail = lambda t, k: t[k * SEQ:k * SEQ + SEQ + 1].tolist()   # noqa: E731
    assert [b.tolist() for b in got] == [[tail(A, 0), tail(B, 0), tail(A, 1), tail(A, 2)],
                                         [tail(A, 3), tail(B, 1), tail(A, 4), tail(A, 5)]]
    short = TokenStream(B[:5].copy(), name="short")               # one window: the second batch needs two
    with pytest.warns(UserWarning, match="hold 1 eval batches of 4, not the 2"):
        assert len(eval_mix_windows([va, short], [0.75, 0.25], SEQ, 4, 2)) == 1
    with pytest.raises(DataError, match=r"vb: its 3 held-out windows .* fewer than the 6 that one held-out batch"):
        eval_mix_windows([va, vb], [0.25, 0.75], SEQ, 8, 1)


def _jsonl(path, text):
    path.write_text("".join(json.dumps({"text": text[i:i + 50]}) + "\n" for i in range(0, len(text), 50)))
    return str(path)


def _config(tmp_path, mix, **data):
    return {"run": {"out": str(tmp_path / "out"), "steps": 2, "seed": 1, "log_every": 1},
            "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
            "data": {"kind": "jsonl", "seq_len": 16, "global_batch": 4, **data},
            "eval": {"batches": 1}, "checkpoint": {"every": 1}, "log": {"plot": False, "tensorboard": False},
            "_mix": mix}


def _write(tmp_path, name, sections):
    """write_config, with data.mix as a TOML array of tables."""
    mix = sections.pop("_mix")
    path = write_config(tmp_path / name, sections)
    with open(path, "a") as f:
        for e in mix:
            f.write("[[data.mix]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in e.items()))
    return path


@pytest.mark.parametrize("mix,extra,match", [
    ([{"path": "a.jsonl", "weight": 0}], {}, r"data.mix\[0\].weight = 0 must be a positive number"),
    ([{"path": "a.jsonl", "weight": 1}, {"path": "b.jsonl", "weight": -0.5}], {},
     r"data.mix\[1\].weight = -0.5 must be a positive number"),
    ([{"path": "a.jsonl", "weight": "0.5"}], {}, r"data.mix\[0\].weight = '0.5' must be a positive number"),
    ([{"path": "a.jsonl", "weight": True}], {}, r"data.mix\[0\].weight = True must be a positive number"),
    ([{"path": "a.jsonl"}], {}, r"data.mix\[0\] has no weight"),
    ([{"path": "a.jsonl", "weight": 1, "wieght": 2}], {}, r"data.mix\[0\]: unknown key\(s\) \['wieght'\]"),
    ([{"path": "a.jsonl", "weight": 1}], {"train": "a.jsonl"}, r"exactly one of data.train .* both are set"),
    ([], {}, r"exactly one of data.train .* neither is"),
])
def test_bad_mix_entries_are_named(tmp_path, mix, extra, match):
    from fxmegatron.train.config import load
    with pytest.raises(ConfigError, match=match):
        load(_write(tmp_path, "c.toml", _config(tmp_path, mix, **extra)))


def test_prepare_mixes_corpora_and_holds_out_each_tail(tmp_path):
    from fxmegatron.train.config import load
    from fxmegatron.train.documents import jsonl_tokens
    from fxmegatron.train.setup import prepare
    text = open(TINY, encoding="utf-8").read()
    a, b = _jsonl(tmp_path / "a.jsonl", text[:3000]), _jsonl(tmp_path / "b.jsonl", text[3000:5000])
    prep = prepare(load(_write(tmp_path, "c.toml", _config(tmp_path, [{"path": a, "weight": 2},
                                                                      {"path": b, "weight": 1}]))), 1)
    (ta, va), (tb, vb) = (split_stream(jsonl_tokens([p], "bytes"), 0.1) for p in (a, b))
    assert (prep.tokens_train, prep.tokens_valid) == (len(ta) + len(tb), len(va) + len(vb)) == (2700 + 1800, 300 + 200)
    want = Mixture([ta, tb], [2, 1], 16, 4, 1)
    for step in range(3):
        assert prep.train.windows(step).tolist() == want.windows(step).tolist()
    assert [w.tolist() for w in prep.valid] == [w.tolist() for w in eval_mix_windows([va, vb], [2, 1], 16, 4, 1)]


@pytest.mark.slow
def test_the_trainer_refuses_to_resume_with_another_weight(tmp_path):
    text = open(TINY, encoding="utf-8").read()
    a, b = _jsonl(tmp_path / "a.jsonl", text[:3000]), _jsonl(tmp_path / "b.jsonl", text[3000:5000])
    r = train(_write(tmp_path, "c.toml", _config(tmp_path, [{"path": a, "weight": 0.7},
                                                           {"path": b, "weight": 0.3}])), 1)
    assert r.returncode == 0, r.stdout
    assert len(rows(tmp_path / "out")) == 2
    cfg = _config(tmp_path, [{"path": a, "weight": 0.6}, {"path": b, "weight": 0.3}])
    cfg["run"]["steps"] = 3
    r = train(_write(tmp_path, "c2.toml", cfg), 1)
    assert r.returncode != 0
    assert "data.mix[0]" in r.stdout and "weight was 0.7 (0.7 normalised), is 0.6 (0.666667 normalised)" in r.stdout, \
        r.stdout


def test_a_corpus_beyond_the_models_vocabulary_is_named(tmp_path):
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "small.bin")
    (np.arange(300, dtype=np.uint16) + 200).tofile(tmp_path / "big.bin")
    cfg = _config(tmp_path, [{"path": str(tmp_path / "small.bin"), "weight": 1},
                             {"path": str(tmp_path / "big.bin"), "weight": 1}], kind="tokens")
    cfg["model"]["gpt"]["vocab_size"] = 400
    with pytest.raises(DataError, match=r"big\.bin\[270:\] \(valid\) holds token ids up to 499, but the model's "
                                        r"vocabulary has 400"):
        prepare(load(_write(tmp_path, "c.toml", cfg)), 1)
