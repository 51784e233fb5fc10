"""``fxmegatron generate TARGET --prompt TEXT``: a completion from a trained model, in one process.

TARGET is a trainer config (its run's latest checkpoint), a checkpoint folder or a model folder
(``train.inference``). The prompt is tokenized as the trainer tokenizes a document (no BOS or
other special tokens): by ``--tokenizer``, else the checkpoint's tokenizer (``tokenizer/``), the
folder's own, the run's ``data.tokenizer``, or, for a model of 256 tokens with none of these, by
its UTF-8 bytes. Greedy at ``--temperature 0`` (the default); else nucleus sampling (``--top-p``,
top-k off) from a generator seeded with ``--seed`` (for ``generate``, torch's global one), so one
seed gives one completion on one machine.

A Hugging Face model generates with its own ``generate`` (its generation_config's other settings
apply), stopping at the tokenizer's EOS, which the trainer puts after every document (without
one, at the model's own). ``generate`` only warns when the prompt and the new tokens together
exceed the model's maximum length. A model that returns its loss, such as the bundled GPT, runs
a plain loop, with transformers' temperature and top-p warpers: the whole context each token (no
KV cache), cropped to its last ``block_size`` tokens (the model's maximum length); its logits are
the output of the last module whose last dimension is the vocabulary (the LM head). It stops at
the tokenizer's EOS, if it has one.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

import torch

from fxmegatron.errors import ConfigError, DataError, FxMegatronError
from fxmegatron.train.inference import Loaded, add_target_arguments, load_target
from fxmegatron.train.status import BAD_INPUT


class Tokenizer:
    """``"bytes"`` (UTF-8, vocabulary 256, no EOS) or a Hugging Face tokenizer folder."""

    def __init__(self, name: str):
        self.name = name
        self.hf = None
        if name != "bytes":
            from fxmegatron.train.documents import load_tokenizer
            self.hf = load_tokenizer(name)

    @property
    def eos(self) -> Optional[int]:
        return self.hf.eos_token_id if self.hf is not None else None

    def encode(self, text: str) -> List[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return list(self.hf(text, add_special_tokens=False, verbose=False)["input_ids"])

    def chat(self, text: str) -> List[int]:
        """``text`` as a user's turn in the tokenizer's chat template, opening the assistant's turn:
        what ``data.format = "chat"`` trained the model to answer."""
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise ConfigError(f"--chat: the tokenizer {self.name} has no chat template")
        return list(self.hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))

    def decode(self, ids: List[int]) -> str:
        if self.hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.hf.decode(ids)


def tokenizer_of(loaded: Loaded, name: Optional[str]) -> Tokenizer:
    name = name or loaded.tokenizer
    if name is None:
        if loaded.source.vocab_size != 256:
            raise ConfigError(f"{loaded.name}: no tokenizer saved with it (and a vocabulary of "
                              f"{loaded.source.vocab_size}, not 256 bytes): give --tokenizer FOLDER")
        name = "bytes"
    return Tokenizer(name)


def _warpers(temperature: float, top_p: float):
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
    out = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


class _LastVocabOutput:
    """The output of the last module, in the forward, whose last dimension is the vocabulary:
    the logits of a model whose forward returns only its loss."""

    def __init__(self, model: torch.nn.Module, vocab: int):
        self.vocab, self.value = vocab, None
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if m is not model]

    def _hook(self, module, args, out):
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] == self.vocab:
            self.value = out

    def close(self):
        for h in self.handles:
            h.remove()


def loop_generate(model, ids: torch.Tensor, max_new: int, block: Optional[int], vocab: int, temperature: float,
                  top_p: float, generator: torch.Generator, eos: Optional[int]) -> torch.Tensor:
    """``ids`` [1, T] continued by up to ``max_new`` tokens of a model called as ``model(x, y)``."""
    warp = _warpers(temperature, top_p) if temperature > 0 else None
    logits_of = _LastVocabOutput(model, vocab)
    try:
        for _ in range(max_new):
            ctx = ids[:, -block:] if block else ids
            logits_of.value = None
            model(ctx, torch.zeros_like(ctx))
            if logits_of.value is None:
                raise ConfigError(f"{type(model).__name__}: no module of its forward outputs logits over its "
                                  f"{vocab} tokens; generate needs a Hugging Face model or one with an LM head")
            logits = logits_of.value[:, -1, :].float()
            if warp is None:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(warp(ctx, logits), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
            if eos is not None and int(nxt) == eos:
                break
    finally:
        logits_of.close()
    return ids


def generate(loaded: Loaded, tok: Tokenizer, prompt: str, max_new: int, temperature: float, top_p: float,
             seed: int, chat: bool = False) -> List[int]:
    """The new tokens' ids (``chat``: the prompt is a user's turn of the chat template)."""
    src, dev = loaded.source, loaded.device
    prompt_ids = tok.chat(prompt) if chat else tok.encode(prompt)
    if not prompt_ids:
        raise DataError("--prompt: the prompt has no tokens; give some text")
    if max(prompt_ids) >= src.vocab_size:
        raise DataError(f"--prompt: the tokenizer {tok.name} gives token id {max(prompt_ids)}, but the model's "
                        f"vocabulary has {src.vocab_size}: the tokenizer does not belong to this model")
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    model = src.model
    with torch.no_grad():
        if hasattr(model, "generate") and src.batch_kind == "hf":
            # transformers samples from torch's global generator: seeding it is what a seed can do
            torch.manual_seed(seed)
            kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
                dict(do_sample=False)
            if tok.eos is not None:     # the trainer ends each document with it: a completion ends there
                kw.update(eos_token_id=tok.eos, pad_token_id=tok.eos)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, **kw)
        else:
            gen = torch.Generator(device=dev).manual_seed(seed)
            out = loop_generate(model, ids, max_new, src.max_positions, src.vocab_size, temperature, top_p, gen,
                                tok.eos)
    return out[0, len(prompt_ids):].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fxmegatron generate", allow_abbrev=False,
                                 description="complete a prompt with a trained model (one process)")
    add_target_arguments(ap, "override a key of the run's config, as fxmegatron train --set")
    ap.add_argument("--prompt", required=True, help="the text to complete")
    ap.add_argument("--chat", action="store_true",
                    help="the prompt is a user's message: rendered by the tokenizer's chat template, the assistant's "
                         "turn opened (for a model trained with data.format = \"chat\"); its end-of-turn is not printed")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass, in (0, 1] (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (default 0)")
    ap.add_argument("--json", action="store_true", help="print one JSON line: the completion and its token ids")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
        if args.temperature < 0:
            raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0: greedy)")
        if not 0 < args.top_p <= 1:
            raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1]")
        loaded = load_target(args.target, args.set, args.device, args.precision)
        if args.set and loaded.config is None:
            raise ConfigError(f"{args.target}: --set changes a run config, and a model folder holds none")
        tok = tokenizer_of(loaded, args.tokenizer)
        new = generate(loaded, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                       args.chat)
    except FxMegatronError as exc:
        print(f"fxmegatron generate: error: {exc}", file=sys.stderr, flush=True)
        return BAD_INPUT
    text = tok.decode(new[:-1] if args.chat and new and new[-1] == tok.eos else new)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "completion": text, "tokens": new}), flush=True)
    else:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
