"""Everything the trainer does before any process group work: read and check the config, open
the data, build the model on the meta device, and check that they fit together (the tokenizer's
vocabulary and the tokens in the files against the model's). A mistake ends here, with one line."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from fxmegatron.errors import ConfigError, DataError, FxMegatronError
from fxmegatron.layout import Layout
from fxmegatron.train import chat, config_checks
from fxmegatron.train.config import TEXT_KINDS, Config
from fxmegatron.train.data import (Batches, eval_windows, memmap_tokens, split_stream, text_tokens,
                                   tokenizer_vocab_size)
from fxmegatron.train.doc_mask import hf_batch
from fxmegatron.train.documents import RECORD_READERS, load_tokenizer, record_tokens
from fxmegatron.train.indexed import indexed_tokens
from fxmegatron.train.init_from import init_state, resumes
from fxmegatron.train.mixture import Mixture, eval_mix_windows
from fxmegatron.train.models import ModelSource, load_model
from fxmegatron.train.wandb_sink import require as require_wandb

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Prepared:
    cfg: Config
    source: ModelSource
    train: Batches
    valid: List[torch.Tensor]          # the held-out windows, [global_batch, seq_len + 1] each
    tokens_train: int
    tokens_valid: int
    vocab_data: int                    # the data's vocabulary (tokenizer's, or max id + 1 in a token file)
    name: str                          # for the log: the model's class and where it came from
    n_params: int                      # the whole model's, tied weights once
    layers: Optional[int]              # from the model's config, for the attention FLOPs (None: unknown)
    hidden: Optional[int]
    layout: Optional[Layout] = None    # the [layout] table as a Layout (seed and gradient sums from [run])
    eos: Optional[int] = None          # data.document_mask: the id that ends a document

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.run.precision]

    @property
    def grad_accum_dtype(self) -> Optional[torch.dtype]:
        return grad_accum_dtype(self.cfg)

    def batch(self, windows: torch.Tensor, device) -> Any:
        """What the model's forward takes, from windows of seq_len + 1 tokens."""
        w = windows.to(device)
        hf = self.source.batch_kind == "hf"
        if self.cfg.data.format != "text":      # tokens masked from the loss come as ~id (chat.py)
            x, labels = chat.decode(w, hf=hf)
        elif hf:                                # the model shifts the labels itself
            x = w[:, :-1].contiguous()
            x, labels = x, x
        else:
            x, labels = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if self.eos is not None:                # data.document_mask (config: HF models only)
            return hf_batch(x, labels, self.eos)
        return {"input_ids": x, "labels": labels} if hf else (x, labels)


def open_streams(cfg: Config, cache_dir: str):
    d = cfg.data

    def open_files(paths):
        if d.kind == "tokens":
            if len(paths) != 1:
                raise ConfigError(f"{cfg.source}: data.kind = 'tokens' reads one .bin file per split, got "
                                  f"{len(paths)}: concatenate them")
            return memmap_tokens(paths[0], d.token_dtype)
        if d.kind == "indexed":
            return indexed_tokens(paths)
        if d.format != "text":      # records with a loss mask (config: jsonl, parquet, hf_dataset)
            return chat.record_masked_tokens(d.kind, paths, chat.record_format(d), cache_dir=cache_dir)
        if d.kind in RECORD_READERS:
            return record_tokens(d.kind, paths, d.tokenizer, d.text_field, cache_dir=cache_dir)
        return text_tokens(paths, d.tokenizer, cache_dir=cache_dir)

    if not d.valid and not 0 < d.valid_fraction < 1:
        raise ConfigError(f"{cfg.source}: data.valid is empty, so data.valid_fraction must be in (0, 1), got "
                          f"{d.valid_fraction}")
    if d.mix:   # lists: each corpus its own stream, and without data.valid its own held-out tail
        corpora = [open_files([e["path"]]) for e in d.mix]
        if d.valid:
            return corpora, open_files(d.valid)
        pairs = [split_stream(c, d.valid_fraction) for c in corpora]
        return [t for t, _ in pairs], [v for _, v in pairs]
    train = open_files(d.train)
    if d.valid:
        valid = open_files(d.valid)
    else:
        train, valid = split_stream(train, d.valid_fraction)
    return train, valid


def _listed(streams) -> list:
    return streams if isinstance(streams, list) else [streams]


def _gpt_options(cfg: Config, vocab: int) -> Dict[str, Any]:
    from fxmegatron.models.gpt import GPTConfig
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    opts = dict(cfg.model.gpt)
    for k in opts:
        if k not in known:
            raise ConfigError(f"{cfg.source}: unknown key model.gpt.{k}; GPTConfig has {', '.join(sorted(known))}")
    if "block_size" in opts and opts["block_size"] < cfg.data.seq_len:
        raise ConfigError(f"{cfg.source}: model.gpt.block_size {opts['block_size']} < data.seq_len "
                          f"{cfg.data.seq_len}")
    opts.setdefault("block_size", cfg.data.seq_len)
    opts.setdefault("vocab_size", vocab)
    return opts


def check_devices(cfg: Config, local_world: int) -> None:
    """A GPU for each of the ``local_world`` processes on this host when ``run.device`` asks for
    cuda, or when it is "auto" and there are GPUs, but fewer than processes (auto would then
    train on the CPU, unasked); raises ConfigError naming the counts."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = cfg.run.device
    if device == "cpu" or have >= local_world or (device == "auto" and have == 0):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    fix = f"start at most {have} per host (torchrun --nproc-per-node) or " if have else ""
    raise ConfigError(f"{cfg.source}: run.device = {device!r} asks for a GPU per process: {local_world} process(es) "
                      f"on this host, but torch sees {have} GPU(s) here{shown}: {fix}set run.device = \"cpu\" "
                      "to train on the CPU")


def prepare(cfg: Config, world: Optional[int]) -> Prepared:
    """The config checked against ``world`` processes (None: not checked, for --dry-run), the data
    opened and the model built on meta; raises ConfigError / DataError naming what is wrong."""
    config_checks.check_world(cfg, world if world is not None else
                              cfg.layout.dp * cfg.layout.pp * cfg.layout.cp * cfg.layout.tp)
    layout = layout_of(cfg)
    config_checks.check_files(cfg)
    config_checks.check_document_mask(cfg)
    if cfg.log.wandb:
        require_wandb(cfg.source)
    train, valid = open_streams(cfg, os.path.join(cfg.run.out, "cache"))
    if cfg.data.kind in TEXT_KINDS:
        vocab_data = tokenizer_vocab_size(cfg.data.tokenizer)
    else:
        vocab_data = max(s.vocab_needed for s in _listed(train) + _listed(valid))
    dtype = DTYPES[cfg.run.precision]
    m = cfg.model
    options = _gpt_options(cfg, vocab_data) if m.kind == "gpt" else {}
    # init_from's weights replace the folder's (not read); a checkpoint of this run wins over both
    source = load_model(m.kind, m.path or None, options, dtype, "random" if m.init_from else m.weights)
    if m.init_from and not resumes(cfg):
        source.state_dict = init_state(m.init_from, source.model, dtype, cfg.source)
    if vocab_data > source.vocab_size:
        big = max(_listed(train) + _listed(valid), key=lambda s: s.vocab_needed)   # the file to name
        files = cfg.data.valid if cfg.data.valid and big in _listed(valid) else cfg.data.train
        what = (f"the tokenizer {cfg.data.tokenizer} has {vocab_data} tokens" if cfg.data.kind in TEXT_KINDS
                else f"{files[0] if files else big.name} holds token ids up to {vocab_data - 1}")
        raise DataError(f"{cfg.source}: {what}, but the model's vocabulary has {source.vocab_size}: the data does "
                        f"not belong to this model{big.dtype_hint}")
    if source.max_positions is not None and cfg.data.seq_len > source.max_positions:
        raise ConfigError(f"{cfg.source}: data.seq_len {cfg.data.seq_len} is longer than the model's "
                          f"{source.max_positions} positions")
    g = cfg.data.global_batch
    if cfg.data.mix:
        weights = [e["weight"] for e in cfg.data.mix]
        batches = Mixture(train, weights, cfg.data.seq_len, g, cfg.run.seed)
        held_out = (eval_windows(valid, cfg.data.seq_len, g, cfg.eval.batches) if cfg.data.valid else
                    eval_mix_windows(valid, weights, cfg.data.seq_len, g, cfg.eval.batches))
    else:
        batches = Batches(train, cfg.data.seq_len, g, cfg.run.seed)
        held_out = eval_windows(valid, cfg.data.seq_len, g, cfg.eval.batches)
    if cfg.data.format != "text":
        chat.check_held_out(held_out, source.batch_kind == "hf", cfg.source)
    model = source.model
    conf = getattr(model, "config", None) or getattr(model, "cfg", None)
    layers = getattr(conf, "num_hidden_layers", None) or getattr(conf, "n_layer", None)
    hidden = getattr(conf, "hidden_size", None) or getattr(conf, "n_embd", None)
    name = type(model).__name__ + (f" from {m.path}" if m.path else "")
    n_params = sum(p.numel() for p in model.parameters())
    tokens_train, tokens_valid = (sum(map(len, _listed(s))) for s in (train, valid))
    return Prepared(cfg, source, batches, held_out, tokens_train, tokens_valid, vocab_data, name, n_params,
                    layers, hidden, layout, _document_end(cfg, source))


def _document_end(cfg: Config, source: ModelSource) -> Optional[int]:
    """data.document_mask: the tokenizer's EOS, which ends each document of the stream."""
    d = cfg.data
    if not d.document_mask:
        return None
    if source.batch_kind != "hf":
        raise ConfigError(f"{cfg.source}: data.document_mask gives the model a per-document attention mask and "
                          f"positions, which only a Hugging Face model's forward takes (attention_mask, "
                          f"position_ids); model.kind = {cfg.model.kind!r}'s does not")
    eos = load_tokenizer(d.tokenizer).eos_token_id
    if eos is None:
        raise ConfigError(f"{cfg.source}: data.document_mask: the tokenizer {d.tokenizer} has no EOS token, so its "
                          f"documents are not marked in the stream")
    return eos


def grad_accum_dtype(cfg: Config) -> Optional[torch.dtype]:
    """fp32 sums of bf16 gradients wherever a step accumulates (microbatches, pipeline chunks)."""
    lay = cfg.layout
    accumulates = lay.microbatches > 1 or lay.pp > 1
    return torch.float32 if DTYPES[cfg.run.precision] != torch.float32 and accumulates else None


def layout_of(cfg: Config) -> Layout:
    """The checked ``[layout]`` table as a ``Layout``, with run.seed and the gradient sums that
    run.precision implies; a combination it refuses is a ConfigError naming the file."""
    try:
        return Layout.from_table(cfg.layout.__dict__, seed=cfg.run.seed, grad_accum_dtype=grad_accum_dtype(cfg))
    except FxMegatronError as e:
        raise ConfigError(f"{cfg.source}: [layout]: {e}") from None
