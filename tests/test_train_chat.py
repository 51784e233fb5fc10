"""``data.format = "chat" | "prompt_completion"``: records made tokens with the prompt masked from
the loss (``fxmegatron/train/chat.py``). Checked against hand-written streams and labels (bytes,
and a word-level tokenizer with a chat template whose every id is known), the errors that name
the record, the cache, the stream's vocabulary and fingerprint, and the trainer: its first loss is
the cross-entropy over the counted targets computed here, and a tp2 fine-tune of a tiny Llama has
the losses of a one-process AdamW loop on masked labels."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from fxmegatron.errors import ConfigError, DataError
from fxmegatron.train import chat
from fxmegatron.train.chat import RecordFormat, decode, jsonl_masked_tokens
from tests.trainer_runs import train, write_config

# A word-level vocabulary: the control tokens, then w0..w99 (id of wK: K + 6).
CONTROL = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
S, U, A, E = 2, 3, 4, 5
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# Rewrites its start as the conversation grows: no prefix of it is the start of the whole.
UNSTABLE = "w{{ messages|length }} " + TEMPLATE


def w(k):
    return k + len(CONTROL)


def chat_tokenizer(path, template=TEMPLATE):
    """A word-level tokenizer (106 tokens) whose control tokens are special, with ``template`` as
    its chat template (None: none), saved with save_pretrained; offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(CONTROL)}
    vocab.update({f"w{k}": w(k) for k in range(100)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(CONTROL[1:])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _all(stream):
    return stream.read(0, len(stream)).tolist()


CONVERSATION = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"},
                {"role": "assistant", "content": "w4 w5"}, {"role": "user", "content": "w6"},
                {"role": "assistant", "content": "w7"}]


# --- prompt_completion ---------------------------------------------------------------------------

def test_prompt_completion_by_bytes_masks_the_prompt(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "cd"}, {"prompt": "x", "completion": "yz"}])
    s = jsonl_masked_tokens([p], RecordFormat("prompt_completion", "bytes"))
    a, b, c, d, x, y, z = b"abcdxyz"
    assert _all(s) == [~a, ~b, c, d, ~x, y, z]           # no EOS: bytes have none
    win = torch.tensor([_all(s)])
    ids, labels = decode(win, hf=False)                   # the bundled GPT: the next token, or -100
    assert ids.tolist() == [[a, b, c, d, x, y]]
    assert labels.tolist() == [[-100, c, d, -100, y, z]]
    ids_hf, labels_hf = decode(win, hf=True)              # HF shifts: label j is position j-1's target
    assert ids_hf.tolist() == ids.tolist()
    assert labels_hf.tolist() == [[-100, -100, c, d, -100, y]]
    assert labels_hf[:, 1:].tolist() == labels[:, :-1].tolist()


def test_prompt_completion_through_the_trainers_batches(tmp_path):
    """prepare + Prepared.batch on the bundled GPT: y is -100 exactly where the target is a prompt's."""
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    recs = [{"prompt": f"q{i}" * 3, "completion": f"a{i}!"} for i in range(30)]
    p = _jsonl(tmp_path / "d.jsonl", recs)
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(tmp_path / "out"), "steps": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"kind": "jsonl", "format": "prompt_completion", "train": p, "seq_len": 8, "global_batch": 2,
                 "valid_fraction": 0.25},
        "eval": {"batches": 1}})
    prep = prepare(load(cfg), 1)
    assert prep.vocab_data == 256
    text = b"".join(r["prompt"].encode() + r["completion"].encode() for r in recs)
    prompt = np.concatenate([[True] * len(r["prompt"]) + [False] * len(r["completion"]) for r in recs])
    for step in range(2):
        win = prep.train.windows(step)
        x, y = prep.batch(win, "cpu")
        for row, i in enumerate(prep.train.indices(step)):
            at = slice(int(i) * 8 + 1, int(i) * 8 + 9)     # the targets' places in the text
            assert x[row].tolist() == list(text[int(i) * 8:int(i) * 8 + 8])
            assert y[row].tolist() == [-100 if m else t for t, m in zip(text[at], prompt[at])]


# --- chat ------------------------------------------------------------------------------------------

def test_chat_counts_the_assistant_turns_only(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    p = _jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION, "id": 7}])
    s = jsonl_masked_tokens([p], RecordFormat("chat", tok))
    # the template's words, by hand: each answer's content and its <|end|> count, nothing else
    want = [~S, ~w(1), ~E, ~U, ~w(2), ~w(3), ~E, ~A, w(4), w(5), E, ~U, ~w(6), ~E, ~A, w(7), E]
    assert _all(s) == want
    from transformers import AutoTokenizer
    rendered = AutoTokenizer.from_pretrained(tok).apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
    assert [~t if t < 0 else t for t in want] == list(rendered)     # ids: the template's own rendering
    ids, labels = decode(torch.tensor([want]), hf=True)
    assert labels.tolist() == [[-100] * 8 + [w(4), w(5), E] + [-100] * 4 + [w(7)]]


def test_chat_cache_is_written_once_and_keyed_by_the_format(tmp_path, monkeypatch):
    tok = chat_tokenizer(tmp_path / "tok")
    p = _jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION, "m2": CONVERSATION[:3]}] * 2)
    cache = tmp_path / "cache"
    calls = []
    real = chat._file_tokens
    monkeypatch.setattr(chat, "_file_tokens", lambda *a: calls.append(a[-1]) or real(*a))
    one = jsonl_masked_tokens([p], RecordFormat("chat", tok), cache_dir=str(cache))
    two = jsonl_masked_tokens([p], RecordFormat("chat", tok), cache_dir=str(cache))
    other = jsonl_masked_tokens([p], RecordFormat("chat", tok, messages_field="m2"), cache_dir=str(cache))
    assert len(calls) == 2                              # messages once, m2 once
    assert _all(one) == _all(two) == _all(jsonl_masked_tokens([p], RecordFormat("chat", tok)))
    assert _all(other) != _all(one) and min(_all(one)) < 0
    assert len(list(cache.glob("masked-*.i32"))) == 2 and not list(cache.glob("*.bin"))


def test_the_vocabulary_and_fingerprint_read_masked_ids(tmp_path):
    from fxmegatron.train.tokens import TokenStream
    ids = np.array([5, 9, 3, 7])
    plain = TokenStream(encode_all(ids, [True] * 4))
    masked = TokenStream(encode_all(ids, [True, False, True, True]))     # the largest id, 9, masked
    other = TokenStream(encode_all(ids, [False, True, True, True]))
    assert plain.vocab_needed == masked.vocab_needed == 10
    fp = [s.fingerprint()["content_sha256"] for s in (plain, masked, other)]
    assert len(set(fp)) == 3                            # the mask is part of the data
    assert fp[0] == TokenStream(ids.astype(np.uint16)).fingerprint()["content_sha256"]   # plain: as before


def encode_all(ids, counted):
    return chat.encode(ids, np.asarray(counted)).astype(np.int32)


# --- errors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("records,template,match", [
    ([{"messages": CONVERSATION}, {"conversation": CONVERSATION}], TEMPLATE,
     r"d\.jsonl:2: the record has no non-empty list field 'messages' \(data\.messages_field\); it has "
     r"\['conversation'\]"),
    ([{"messages": [{"role": "human", "content": "w1"}, {"role": "assistant", "content": "w2"}]}], TEMPLATE,
     r"d\.jsonl:1: message 0 has role 'human'; a role is one of system, user, assistant, tool"),
    ([{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant"}]}], TEMPLATE,
     r"d\.jsonl:1: message 1 must be an object with string 'role' and 'content'"),
    ([{"messages": CONVERSATION[1:2]}], TEMPLATE, r"d\.jsonl:1: no token of the record counts in the loss"),
    ([{"messages": CONVERSATION}, ["messages"]], TEMPLATE, r"d\.jsonl:2: a record must be an object, got list"),
    ([{"messages": CONVERSATION[2:]}], TEMPLATE, r"d\.jsonl:1: message 0 is the assistant's"),
    ([{"messages": CONVERSATION}], UNSTABLE,
     r"d\.jsonl:1: the chat template of .* is not prefix-stable: messages\[:2\] with the generation prompt does "
     r"not render as the start of messages\[:3\]"),
])
def test_a_bad_conversation_is_named(tmp_path, records, template, match):
    tok = chat_tokenizer(tmp_path / "tok", template)
    p = _jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(DataError, match=match):
        jsonl_masked_tokens([p], RecordFormat("chat", tok))


@pytest.mark.parametrize("record,match", [
    ({"prompt": "ab"}, r"d\.jsonl:1: the record has no string field 'completion' \(data\.completion_field\); it "
                       r"has \['prompt'\]"),
    ({"prompt": "ab", "completion": ""}, r"d\.jsonl:1: no token of the record counts in the loss"),
])
def test_a_bad_prompt_completion_is_named(tmp_path, record, match):
    p = _jsonl(tmp_path / "d.jsonl", [record])
    with pytest.raises(DataError, match=match):
        jsonl_masked_tokens([p], RecordFormat("prompt_completion", "bytes"))


def test_chat_needs_a_tokenizer_with_a_template(tmp_path):
    from fxmegatron.train.config import from_dict
    data = {"kind": "jsonl", "format": "chat", "train": "d.jsonl", "seq_len": 8, "global_batch": 2}
    with pytest.raises(ConfigError, match=r"c\.toml: data\.format = 'chat' renders conversations with the "
                                          r"tokenizer's chat template, and data\.tokenizer = 'bytes' has none"):
        from_dict({"run": {"steps": 1}, "data": data}, "c.toml")
    with pytest.raises(ConfigError, match=r"c\.toml: data\.format = 'chat' reads records: it needs data\.kind = "
                                          r"'jsonl', 'parquet' or 'hf_dataset', not 'text'"):
        from_dict({"run": {"steps": 1}, "data": dict(data, kind="text", tokenizer="tok")}, "c.toml")
    bare = chat_tokenizer(tmp_path / "bare", template=None)
    p = _jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ConfigError, match=r"bare: the tokenizer has no chat template"):
        jsonl_masked_tokens([p], RecordFormat("chat", bare))


def test_a_held_out_batch_with_nothing_counted_is_refused(tmp_path):
    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    train = _jsonl(tmp_path / "t.jsonl", [{"prompt": "ab", "completion": "cdef"}] * 10)
    valid = _jsonl(tmp_path / "v.jsonl", [{"prompt": "q" * 40, "completion": "a"}])
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(tmp_path / "out"), "steps": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"kind": "jsonl", "format": "prompt_completion", "train": train, "valid": valid, "seq_len": 8,
                 "global_batch": 2},
        "eval": {"batches": 1}})
    with pytest.raises(DataError, match=r"c\.toml: held-out batch 0 \(2 windows of 9 tokens\) has no target that "
                                        r"counts in the loss"):
        prepare(load(cfg), 1)


# --- the trainer ---------------------------------------------------------------------------------------

def test_a_step_with_nothing_counted_is_nonfinite_not_zero(tmp_path):
    """A global batch whose every target is a prompt's: the loss is NaN (0/0, never a made-up 0),
    its gradient 0, and the trainer's non-finite check takes it (run.on_nonfinite: stop or skip)."""
    import fxmegatron
    from fxmegatron.train.config import load
    from fxmegatron.train.loop import _nonfinite_rank
    from fxmegatron.train.setup import prepare
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "qqqq", "completion": "ab"}] * 40)
    cfg = write_config(tmp_path / "c.toml", {
        "run": {"out": str(tmp_path / "out"), "steps": 1},
        "model": {"kind": "gpt", "gpt": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
        "data": {"kind": "jsonl", "format": "prompt_completion", "train": p, "seq_len": 8, "global_batch": 2},
        "layout": {"microbatches": 2}, "eval": {"batches": 1}})
    prep = prepare(load(cfg), 1)
    some = prep.train.windows(0)
    none = torch.from_numpy(np.stack([chat.encode(range(40, 49), [False] * 9)] * 2))
    assert chat.counted_targets(none, False) == 0 < chat.counted_targets(some, False)
    pm = fxmegatron.parallelize(prep.source.model, None, prep.batch(some, "cpu"), microbatches=2)
    loss = pm.train_step(prep.batch(none, "cpu")).item()
    norm = pm.grad_norm().item()
    assert math.isnan(loss) and norm == 0.0
    assert _nonfinite_rank(loss, norm, "cpu") == 0


def _conversations(n, rng):
    """Conversations with long prompts and short answers: many windows count nothing."""
    def words(k):
        return " ".join(f"w{int(i)}" for i in rng.integers(0, 100, k))
    out = []
    for _ in range(n):
        msgs = [{"role": "user", "content": words(int(rng.integers(6, 20)))},
                {"role": "assistant", "content": words(int(rng.integers(1, 4)))}]
        if rng.random() < 0.5:
            msgs += [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(2)}]
        out.append({"messages": msgs})
    return out


def _hand_loss(model, win):
    """The mean over the counted targets of -log p(target), each picked by hand (no -100 labels):
    HF's inputs are the window's first seq_len ids, and position j's target is token j + 1."""
    ids = torch.where(win < 0, ~win, win)
    logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.float(), -1)
    terms = [-logp[b, j, ids[b, j + 1]] for b in range(win.shape[0]) for j in range(win.shape[1] - 2)
             if win[b, j + 1] >= 0]
    return torch.stack(terms).mean()


def test_a_chat_finetune_at_tp2_is_the_masked_loss_loop(tmp_path):
    from transformers import AutoModelForCausalLM

    from fxmegatron.train.config import load
    from fxmegatron.train.setup import prepare
    from tests.families import FAMILIES
    torch.manual_seed(0)
    FAMILIES["llama"].build(n_layer=2).save_pretrained(tmp_path / "llama")     # vocab 128, GQA, untied
    tok = chat_tokenizer(tmp_path / "tok")
    data = _jsonl(tmp_path / "chat.jsonl", _conversations(40, np.random.default_rng(0)))
    steps, lr = 3, 1e-3
    cfg = write_config(tmp_path / "ft.toml", {
        "run": {"out": str(tmp_path / "run"), "steps": steps, "seed": 8},
        "model": {"kind": "hf", "path": str(tmp_path / "llama")},
        "data": {"kind": "jsonl", "format": "chat", "tokenizer": tok, "train": data, "seq_len": 16,
                 "global_batch": 2},
        "layout": {"tp": 2, "microbatches": 2},
        "optim": {"lr": lr, "decay": "constant", "grad_clip": 0.0, "fused": False},
        "eval": {"batches": 1},
        "log": {"plot": False, "tensorboard": False}})
    prep = prepare(load(cfg), 2)
    batches = [prep.train.windows(k) for k in range(steps)]
    # the first step's microbatches: one window counts nothing, the other something (the weighting shows)
    first = [int((batches[0][r, 1:-1] >= 0).sum()) for r in range(2)]
    assert 0 in first and max(first) > 0, first
    r = train(cfg, 2)
    assert r.returncode == 0, r.stdout
    with open(tmp_path / "run" / "loss.csv", newline="") as f:
        got = [float(row["loss"]) for row in csv.DictReader(f)]
    # the reference: the unmodified model, one process, masked labels, torch's AdamW as the trainer's
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", local_files_only=True, torch_dtype=torch.float32)
    with torch.no_grad():
        hand = _hand_loss(model, batches[0]).item()
    assert abs(got[0] - hand) <= 1e-5 * hand, (got[0], hand)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    want = []
    for win in batches:
        ids = torch.where(win < 0, ~win, win)[:, :-1]
        labels = torch.where(win[:, :-1] < 0, -100, ids)
        loss = model(input_ids=ids, labels=labels).loss
        want.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert math.isclose(want[0], hand, rel_tol=1e-6)
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * b, (k, got, want)
    assert got[-1] < got[0]


def test_parquet_and_datasets_rows_are_records_as_jsonl_lines_are(tmp_path):
    """Chat and prompt/completion rows of a Parquet file and of a datasets folder (a list of
    {role, content} structs, string columns) give the JSON Lines file's stream, token for token."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    tok = chat_tokenizer(tmp_path / "tok")
    rows = [{"messages": CONVERSATION, "prompt": "w1 w2", "completion": "w3"},
            {"messages": CONVERSATION[1:3], "prompt": "w9", "completion": "w8 w7"}]
    p_jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=1)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for fmt in (RecordFormat("chat", tok), RecordFormat("prompt_completion", tok)):
        want = _all(jsonl_masked_tokens([p_jsonl], fmt))
        assert any(t < 0 for t in want) and any(t >= 0 for t in want)
        for kind, path in (("parquet", tmp_path / "d.parquet"), ("hf_dataset", tmp_path / "ds")):
            assert _all(chat.record_masked_tokens(kind, [str(path)], fmt)) == want, (kind, fmt.format)
            cached = chat.record_masked_tokens(kind, [str(path)], fmt, cache_dir=str(tmp_path / f"c-{kind}"))
            assert _all(cached) == want, (kind, "cached")
    with pytest.raises(DataError, match=r"d.parquet: row 0"):      # a row is named as a JSON line is
        bad = tmp_path / "bad.parquet"
        pq.write_table(pa.Table.from_pylist([{"text": "w1"}]), bad)
        chat.record_masked_tokens("parquet", [str(bad)], RecordFormat("chat", tok))
