"""``fxmegatron eval`` and ``fxmegatron generate``: eval of a trainer checkpoint is the validation loss
the trainer logged; eval of a Hugging Face folder is the loss the HF model computes on windows cut by
hand; greedy generation is ``model.generate(do_sample=False)`` (HF) or an argmax loop written here
(the bundled GPT, past its block size); sampling is reproducible by seed; bad input ends with 2."""
import json
import math
import os
import random

import numpy as np
import pytest
import torch

from fxmegatron.cli import main
from fxmegatron.io.checkpoint import read_full_state
from fxmegatron.models.gpt import GPT, GPTConfig
from fxmegatron.train.export import export_checkpoint
from tests.families import FAMILIES
from tests.trainer_runs import TINY, rows, tiny_tokenizer, train, write_config

GPT_OPTIONS = {"n_layer": 1, "n_head": 2, "n_embd": 32}
SEQ, BATCH = 32, 4


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """A 3-step one-process run of a tiny GPT on the bytes of tiny.txt; its config, last checkpoint
    and the validation loss it logged."""
    root = tmp_path_factory.mktemp("evgen")
    cfg = write_config(root / "gpt.toml", {
        "run": {"out": str(root / "run"), "steps": 3, "seed": 1},
        "model": {"kind": "gpt", "gpt": GPT_OPTIONS},
        "data": {"train": TINY, "seq_len": SEQ, "global_batch": BATCH},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "eval": {"batches": 2},
        "log": {"plot": False, "tensorboard": False},
    })
    r = train(cfg, 1)
    assert r.returncode == 0, r.stdout
    val = float(rows(root / "run")[-1]["val_loss"])
    return root, cfg, str(root / "run" / "checkpoints" / "step-00000003"), val


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Llama (vocabulary 128) saved with save_pretrained, a word-level tokenizer of 100 tokens
    beside it, and a text of its words."""
    root = tmp_path_factory.mktemp("evgen_hf")
    folder = root / "llama"
    FAMILIES["llama"].build(n_layer=1).save_pretrained(folder)
    tiny_tokenizer(folder, vocab=100)
    rng = random.Random(0)
    (root / "words.txt").write_text(" ".join(f"w{rng.randrange(98)}" for _ in range(300)))
    return str(folder), str(root / "words.txt")


def _json(capsys, argv):
    code = main(argv + ["--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def _error(capsys, argv, text):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err, err


def _trained_gpt(ckpt):
    model = GPT(GPTConfig(**GPT_OPTIONS, block_size=SEQ, vocab_size=256))
    missing, unexpected = model.load_state_dict(read_full_state(ckpt), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected       # tied to wte, stored once
    return model.eval()


def _gpt_loss(model, windows):
    with torch.no_grad():
        return sum(model(w[:, :-1], w[:, 1:]).item() for w in windows) / len(windows)


def test_eval_of_checkpoint_is_the_trainers_validation_loss(gpt_run, capsys):
    _, cfg, ckpt, val = gpt_run
    for target in (cfg, ckpt):
        got = _json(capsys, ["eval", target])
        assert abs(got["loss"] - val) <= 1e-6, (got, val)
        assert got["tokens"] == 2 * BATCH * SEQ and got["ppl"] == pytest.approx(math.exp(val), rel=1e-5)
    assert main(["eval", cfg]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"eval: loss {got['loss']:.6f}  ppl {got['ppl']:.2f}  on 256 tokens ("), line


def test_eval_on_other_files_is_the_models_loss_on_their_windows(gpt_run, capsys, tmp_path):
    """--data: every whole batch of the file's windows (seq_len + 1 bytes, stepping by seq_len), cut
    here by hand, through the checkpoint's model, the exported folder's and the trained GPT's."""
    _, _, ckpt, _ = gpt_run
    text = open(TINY, "rb").read()[:5000]
    data = tmp_path / "part.txt"
    data.write_bytes(text)
    seq, batch = 16, 3
    ids = torch.tensor(list(text))
    n = (len(ids) - 1) // seq
    wins = torch.stack([ids[i * seq:i * seq + seq + 1] for i in range(n // batch * batch)])
    want = _gpt_loss(_trained_gpt(ckpt), wins.split(batch))
    flags = ["--data", str(data), "--seq-len", str(seq), "--batch", str(batch)]
    got = _json(capsys, ["eval", ckpt] + flags)
    assert abs(got["loss"] - want) <= 1e-6 and got["tokens"] == wins.shape[0] * seq, (got, want)
    exported = export_checkpoint(ckpt, str(tmp_path / "gpt"))
    got = _json(capsys, ["eval", exported] + flags + ["--batches", "2"])
    assert abs(got["loss"] - _gpt_loss(_trained_gpt(ckpt), wins.split(batch)[:2])) <= 1e-6


def test_eval_of_hf_folder_is_the_hf_models_loss(hf_folder, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, words = hf_folder
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tok(open(words).read(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    seq, batch = 16, 2
    n = (len(ids) - 1) // seq // batch * batch
    wins = torch.stack([ids[i * seq:i * seq + seq + 1] for i in range(n)])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():       # the trainer's HF batch: the model shifts labels == inputs
        losses = [model(input_ids=w[:, :-1], labels=w[:, :-1]).loss.item() for w in wins.split(batch)]
    got = _json(capsys, ["eval", folder, "--data", words, "--seq-len", str(seq), "--batch", str(batch)])
    assert abs(got["loss"] - sum(losses) / len(losses)) <= 1e-6, (got, losses)
    assert got["tokens"] == n * (seq - 1) and got["batches"] == n // batch


def test_generate_hf_greedy_is_model_generate(hf_folder, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, _ = hf_folder
    prompt = "w3 w17 w42 w5"
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    got = _json(capsys, ["generate", folder, "--prompt", prompt, "--max-new-tokens", "12"])
    assert got["tokens"] == want and len(want) > 1
    assert got["completion"] == tok.decode(want)
    sampled = [_json(capsys, ["generate", folder, "--prompt", prompt, "--temperature", "1", "--top-p", "0.9",
                              "--seed", str(s)])["tokens"] for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def _argmax_loop(model, ids, new, block):
    """Greedy decoding written out: the logits of the last position, from the GPT's modules."""
    with torch.no_grad():
        for _ in range(new):
            x = torch.tensor([ids[-block:]])
            h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
            for b in model.blocks:
                h = b(h)
            ids = ids + [int(model.lm_head(model.ln_f(h))[0, -1].argmax())]
    return ids


def _sharp_gpt_folder(path, block):
    """A random GPT whose logits hang on every token of the context (matrices of std 0.2, not 0.02;
    untied, else its likeliest next token is the last one),
    written as ``fxmegatron export`` writes one: greedy decoding of it shows any change of context."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    cfg = GPTConfig(**GPT_OPTIONS, block_size=block, vocab_size=256, tie_embeddings=False)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path.mkdir()
    save_file(model.state_dict(), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"fxmegatron_model": "gpt", "gpt_config": cfg.__dict__}))
    return model


def test_generate_gpt_greedy_is_an_argmax_loop_past_its_block_size(gpt_run, capsys, tmp_path):
    _, cfg, ckpt, _ = gpt_run
    prompt, new = "The king ", SEQ + 8          # the context outgrows block_size = SEQ: cropped
    want = _argmax_loop(_trained_gpt(ckpt), list(prompt.encode()), new, SEQ)[len(prompt):]
    got = _json(capsys, ["generate", ckpt, "--prompt", prompt, "--max-new-tokens", str(new)])
    assert got["tokens"] == want and got["completion"] == bytes(want).decode("utf-8", errors="replace")
    sharp = _sharp_gpt_folder(tmp_path / "sharp", block=6)
    want_sharp = _argmax_loop(sharp, list(prompt.encode()), 20, 6)[len(prompt):]
    assert len(set(want_sharp)) > 5       # not one byte repeated: the loop's context matters
    assert _json(capsys, ["generate", str(tmp_path / "sharp"), "--prompt", prompt, "--max-new-tokens", "20"]
                 )["tokens"] == want_sharp
    assert main(["generate", cfg, "--prompt", prompt, "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == bytes(want[:5]).decode("utf-8", errors="replace") + "\n"
    # top-p keeping only the most likely token is greedy; a seed gives one completion
    argv = ["generate", ckpt, "--prompt", prompt, "--max-new-tokens", "10", "--temperature", "1"]
    assert _json(capsys, argv + ["--top-p", "1e-6", "--seed", "5"])["tokens"] == want[:10]
    runs = [_json(capsys, argv + ["--top-p", "0.95", "--seed", str(s)])["tokens"] for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0] != want[:10]


def test_bad_input_is_one_line_and_status_2(gpt_run, hf_folder, capsys, tmp_path):
    _, cfg, ckpt, _ = gpt_run
    folder, words = hf_folder
    (tmp_path / "empty").mkdir()
    _error(capsys, ["eval", str(tmp_path / "empty")], "is neither a trainer config (TOML file), a checkpoint "
                                                      "folder (with index.json) nor a model folder")
    _error(capsys, ["generate", str(tmp_path / "nope"), "--prompt", "a"], "nope does not exist")
    _error(capsys, ["eval", os.path.dirname(ckpt)], f"is a folder of checkpoints, not one: name one of them, e.g. "
                                                     f"the latest, {ckpt}")
    big = tmp_path / "big.bin"
    np.array([1, 2, 300, 4] * 100, dtype=np.uint16).tofile(big)
    _error(capsys, ["eval", ckpt, "--data", str(big), "--data-kind", "tokens", "--seq-len", "8", "--batch", "2"],
           "holds token ids up to 300, but the model's vocabulary has 256")
    _error(capsys, ["eval", folder], "holds no run config: give --data FILE")
    wide = tiny_tokenizer(tmp_path / "wide", vocab=300)
    _error(capsys, ["eval", ckpt, "--data", words, "--tokenizer", str(wide), "--seq-len", "8"],
           f"the tokenizer {wide} has 300 tokens, but the model's vocabulary has 256")
    _error(capsys, ["eval", ckpt, "--seq-len", "64", "--data", TINY], "seq_len 64 is longer than the model's 32")
    _error(capsys, ["eval", cfg, "--set", "checkpoint.dir=" + json.dumps(str(tmp_path))],
           f"no complete checkpoint in {tmp_path}")
    plain = tmp_path / "plain"
    FAMILIES["llama"].build(n_layer=1).save_pretrained(plain)          # no tokenizer, vocabulary 128
    capsys.readouterr()         # save_pretrained's progress bar
    _error(capsys, ["generate", str(plain), "--prompt", "a"], "give --tokenizer FOLDER")
    _error(capsys, ["generate", folder, "--prompt", "w1", "--set", "run.steps=2"], "a model folder holds none")
    _error(capsys, ["eval", folder, "--data", words, "--set", "data.kind=txt"], "data.kind = 'txt' is not one of")
    _error(capsys, ["generate", ckpt, "--prompt", "a", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]")
    _error(capsys, ["generate", ckpt, "--prompt", ""], "the prompt has no tokens")
    _error(capsys, ["generate", ckpt, "--prompt", "w1 w2", "--tokenizer", str(tmp_path / "none")],
           "no such directory")


def test_generate_chat_needs_a_chat_template(hf_folder, capsys):
    folder, _ = hf_folder       # its word-level tokenizer has none (the README's walk-through uses one that has)
    _error(capsys, ["generate", folder, "--chat", "--prompt", "w3"], "--chat: the tokenizer")
