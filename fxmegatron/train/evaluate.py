"""``fxmegatron eval TARGET``: the held-out loss and perplexity of a trained model, in one process.

TARGET is a trainer config (its run's latest checkpoint), a checkpoint folder or a model folder
(``train.inference``). The data is the run's held-out split, as the trainer evaluates it (the first
``eval.batches`` global batches of ``data.valid``, or of the held-out tail of ``data.train``), or
``--data`` files read as ``data.kind`` says (``--data-kind``, ``--tokenizer``, ``--seq-len``,
``--batch`` override the run's values; a model folder has no run, so they are needed there).
The windows go through the trainer's own code (``setup``'s streams, ``data.eval_windows``,
``Prepared.batch``), so the loss is the trainer's validation loss: the mean over batches of each
batch's mean token loss, computed by the unmodified model in eval mode.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any, Dict, Optional

import torch

from fxmegatron.errors import ConfigError, DataError, FxMegatronError
from fxmegatron.train.config import TEXT_KINDS, Config, from_dict
from fxmegatron.train.data import eval_windows, num_windows, tokenizer_vocab_size
from fxmegatron.train.inference import Loaded, add_target_arguments, load_target
from fxmegatron.train.setup import Prepared, open_streams
from fxmegatron.train.status import BAD_INPUT

# a model folder has no run: its sequences are at most this long unless --seq-len says otherwise
DEFAULT_SEQ_LEN, DEFAULT_BATCH = 512, 8


def data_config(loaded: Loaded, args) -> Config:
    """The run's config with the data flags in place of its values (``--data``: these files as
    the held-out split); a model folder has no run: a config made of the flags alone."""
    flags = {k: v for k, v in (("kind", args.data_kind), ("tokenizer", args.tokenizer), ("seq_len", args.seq_len),
                               ("global_batch", args.batch)) if v is not None}
    if not args.data:
        if loaded.config is None:
            raise ConfigError(f"{loaded.name} holds no run config: give --data FILE (and --seq-len, --batch)")
        if not flags:
            return loaded.config
    base: Dict[str, Any] = loaded.config.as_dict() if loaded.config is not None else {"run": {"steps": 1}}
    data = dict(base.get("data") or {})
    if args.data:
        data.update(train=list(args.data), valid=list(args.data))
        tokenizer = loaded.tokenizer or ("bytes" if loaded.source.vocab_size == 256 else None)
        if tokenizer is not None:      # the checkpoint's own (byte-level runs have none: vocabulary 256)
            data["tokenizer"] = tokenizer
    data.update(flags)
    if "seq_len" not in data:
        if loaded.source.max_positions is None:
            raise ConfigError(f"{loaded.name}: the model states no maximum length and there is no run config: "
                              "give --seq-len N")
        data["seq_len"] = min(loaded.source.max_positions, DEFAULT_SEQ_LEN)
    data.setdefault("global_batch", DEFAULT_BATCH)
    base["data"] = data
    # the flags checked as the config keys they set: a bad value is named as data.<key>
    return from_dict(base, "the command line (--data, --data-kind, --tokenizer, --seq-len, --batch)", os.getcwd(),
                     args.set if loaded.config is None else None)     # a run's config has them already


def held_out(loaded: Loaded, cfg: Config, batches: Optional[int]):
    """The first ``batches`` evaluation batches (None: every whole one) of ``cfg``'s held-out
    data, checked against the model."""
    d = cfg.data
    if loaded.source.max_positions is not None and d.seq_len > loaded.source.max_positions:
        raise ConfigError(f"{cfg.source}: seq_len {d.seq_len} is longer than the model's "
                          f"{loaded.source.max_positions} positions")
    if d.kind in TEXT_KINDS and d.tokenizer != "bytes" and not os.path.isdir(d.tokenizer):
        raise ConfigError(f"{cfg.source}: tokenizer {d.tokenizer} is not a directory (saved with save_pretrained), "
                          "nor 'bytes'")
    # the run's token cache when there is a run here; else a throwaway one
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(cfg.run.out, "cache") if os.path.isdir(cfg.run.out) and loaded.config else tmp
        _, valid = open_streams(cfg, cache)
        vocab = tokenizer_vocab_size(d.tokenizer) if d.kind in TEXT_KINDS else 0
        needed = max(valid.vocab_needed, vocab)
        if needed > loaded.source.vocab_size:
            what = (f"the tokenizer {d.tokenizer} has {vocab} tokens" if vocab == needed
                    else f"{valid.name} holds token ids up to {needed - 1}")
            raise DataError(f"{what}, but the model's vocabulary has {loaded.source.vocab_size}: the data does not "
                            f"belong to this model{valid.dtype_hint}")
        if batches is None:         # files given on the command line: all of them
            batches = max(1, num_windows(valid, d.seq_len) // d.global_batch)
        windows = eval_windows(valid, d.seq_len, d.global_batch, batches)
    return valid, windows


def _loss(model, batch) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(*batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def _counted(batch) -> int:
    """Tokens whose prediction the loss counts (labels of -100 are not): an HF model shifts its
    labels itself, so a window's first label predicts nothing."""
    if isinstance(batch, dict):
        return int((batch["labels"][:, 1:] != -100).sum())
    return int((batch[1] != -100).sum())


def evaluate(loaded: Loaded, cfg: Config, windows) -> Dict[str, Any]:
    src = loaded.source
    # the trainer's own batch code (Prepared.batch), so a window reads as it did in training
    prep = Prepared(cfg=cfg, source=src, train=None, valid=windows, tokens_train=0, tokens_valid=0,
                    vocab_data=src.vocab_size, name=loaded.name, n_params=0, layers=None, hidden=None)
    losses, tokens = [], 0
    with torch.no_grad():
        for i, w in enumerate(windows):
            batch = prep.batch(w, loaded.device)
            counted = _counted(batch)
            if counted == 0:        # the trainer refuses such a held-out batch too: its loss is 0/0
                raise DataError(f"{cfg.source}: held-out batch {i} has no target that counts in the loss (every "
                                "token is a masked prompt's); give longer data or a larger --batch")
            losses.append(_loss(src.model, batch).float().item())
            tokens += counted
    loss = sum(losses) / len(losses)
    if not math.isfinite(loss):
        raise DataError(f"{loaded.name}: the loss is {loss} on this data (non-finite weights or logits)")
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf"), "tokens": tokens,
            "batches": len(windows), "batch": cfg.data.global_batch, "seq_len": cfg.data.seq_len}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fxmegatron eval", allow_abbrev=False,
                                 description="held-out loss and perplexity of a trained model (one process)")
    add_target_arguments(ap, "override a key of the run's config, as fxmegatron train --set (a model folder: of "
                             "the config the data flags make, e.g. data.format)")
    ap.add_argument("--data", nargs="+", default=None, metavar="FILE",
                    help="evaluate on these files (default: the run's held-out split)")
    ap.add_argument("--data-kind", default=None, help="how to read --data: text, jsonl, tokens, indexed "
                                                      "(default: the run's data.kind, else text)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (default: the run's global batch)")
    ap.add_argument("--batches", type=int, default=None,
                    help="batches to evaluate (default: the run's eval.batches; with --data, every whole batch)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.batches is not None and args.batches < 1:
            raise ConfigError(f"--batches {args.batches}: must be >= 1")
        loaded = load_target(args.target, args.set, args.device, args.precision)
        cfg = data_config(loaded, args)
        batches = args.batches if args.batches is not None or args.data else cfg.eval.batches
        valid, windows = held_out(loaded, cfg, batches)
        result = evaluate(loaded, cfg, windows)
    except FxMegatronError as exc:
        print(f"fxmegatron eval: error: {exc}", file=sys.stderr, flush=True)
        return BAD_INPUT
    result.update(model=loaded.name, data=valid.name)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"eval: loss {result['loss']:.6f}  ppl {result['ppl']:.2f}  on {result['tokens']:,} tokens "
              f"({result['batches']} batches of {result['batch']} x {result['seq_len']} from {valid.name}; "
              f"{loaded.name})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
