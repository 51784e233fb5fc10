"""The README's walk-through, run as a new user runs it: its bash block, line by line, from a
fresh folder (the repository's examples beside it, outputs under it). Every command ends with 0,
and what the README says of them holds: ``eval`` of the config prints the validation loss the
trainer logged last, ``eval`` of the exported folder is that folder's loss on the data, and
``generate --chat`` is transformers' own greedy ``generate`` from the chat template's prompt."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.trainer_runs import ROOT, env, rows

BIN = os.path.dirname(sys.executable)


def walkthrough():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"<!-- walkthrough:[^\n]*-->\n```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no walk-through block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(tmp_path):
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    out = {}
    for line in walkthrough():
        argv = shlex.split(line)
        assert argv[0].startswith(".venv/bin/"), line
        argv[0] = os.path.join(BIN, argv[0][len(".venv/bin/"):])
        if argv[1] in ("eval", "generate"):
            argv.append("--json")
        r = subprocess.run(argv, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=600)
        assert r.returncode == 0, (line, r.stdout[-3000:], r.stderr[-3000:])
        out[line] = r.stdout
    lines = walkthrough()
    evals = [json.loads(out[l].strip().splitlines()[-1]) for l in lines if " eval " in l]
    logged = rows(tmp_path / "runs" / "hf_chat_tiny")[-1]
    assert abs(evals[0]["loss"] - float(logged["val_loss"])) <= 1e-6, (evals[0], logged)
    # the exported folder on the data file: the checkpoint it came from, evaluated the same way
    folder_eval = shlex.split(next(l for l in lines if " eval runs/" in l))
    folder_eval[0] = os.path.join(BIN, "fxmegatron")
    folder_eval[2] = os.path.join(tmp_path, "runs", "hf_chat_tiny", "checkpoints", "step-00000300")
    # (a model folder's default batch is 8; a checkpoint's, its run's global batch)
    r = subprocess.run(folder_eval + ["--batch", "8", "--json"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE, text=True,
                       timeout=600)
    ckpt = json.loads(r.stdout.strip().splitlines()[-1])
    assert abs(evals[1]["loss"] - ckpt["loss"]) <= 1e-5 and evals[1]["tokens"] == ckpt["tokens"], (evals[1], ckpt)
    assert evals[1]["loss"] < evals[0]["loss"] * 2, evals        # a model evaluated at the length it learned

    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = tmp_path / "runs" / "tiny-llama-chat"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    gen = next(l for l in lines if " generate " in l)
    prompt = shlex.split(gen)[shlex.split(gen).index("--prompt") + 1]
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    import torch
    ids = torch.tensor([ids])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    got = json.loads(out[gen].strip().splitlines()[-1])
    assert got["tokens"] == want, (got, want)
    assert got["completion"] == tok.decode(want[:-1] if want[-1] == tok.eos_token_id else want)
    print(f"\nREADME walk-through: eval {evals[0]['loss']:.4f} (logged {logged['val_loss']}), "
          f"exported folder {evals[1]['loss']:.4f}; generate {prompt!r} -> {got['completion']!r}")
