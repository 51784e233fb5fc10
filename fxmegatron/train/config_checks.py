"""What a checked config is held against before a run starts: the number of processes (and
the batch against the layout), and the files it names on disk. ``config.from_dict`` checks the
keys and values alone; these need the world or the disk."""
from __future__ import annotations

import os

from fxmegatron.errors import ConfigError
from fxmegatron.train.config import TEXT_KINDS, Config
from fxmegatron.train.indexed import prefix_of


def check_world(cfg: Config, world: int) -> None:
    """The layout against the number of processes, and the batch against the layout."""
    lay = cfg.layout
    product = lay.dp * lay.pp * lay.cp * lay.tp
    if product != world:
        raise ConfigError(f"{cfg.source}: layout dp {lay.dp} x pp {lay.pp} x cp {lay.cp} x tp {lay.tp} = {product}, "
                          f"but {world} processes were started (torchrun --nproc_per_node): they must be equal")
    b = cfg.data.global_batch
    if b % (lay.dp * lay.microbatches):
        raise ConfigError(f"{cfg.source}: data.global_batch {b} must be divisible by layout.dp {lay.dp} x "
                          f"layout.microbatches {lay.microbatches} = {lay.dp * lay.microbatches}")
    if cfg.data.seq_len % (2 * lay.cp):
        raise ConfigError(f"{cfg.source}: data.seq_len {cfg.data.seq_len} must be divisible by 2 x layout.cp "
                          f"{lay.cp} = {2 * lay.cp} (each cp rank holds two chunks of the sequence)")
    if lay.sequence_parallel and lay.tp == 1:
        raise ConfigError(f"{cfg.source}: layout.sequence_parallel needs layout.tp > 1")
    if lay.fuse and lay.compile:
        raise ConfigError(f"{cfg.source}: layout.fuse and layout.compile are alternatives; pick one")
    if lay.virtual_stages > 1 and lay.pp == 1:
        raise ConfigError(f"{cfg.source}: layout.virtual_stages {lay.virtual_stages} needs layout.pp > 1")


def check_files(cfg: Config) -> None:
    """Every file the run reads exists (data, tokenizer, model)."""
    for p in cfg.data.train + [e["path"] for e in cfg.data.mix] + cfg.data.valid:
        if cfg.data.kind == "hf_dataset":
            if not os.path.isdir(p):
                raise ConfigError(f"{cfg.source}: data folder {p} does not exist (data.kind = 'hf_dataset' reads "
                                  "folders written by datasets' save_to_disk)")
        elif cfg.data.kind == "indexed":      # Megatron's PREFIX (or PREFIX.bin / .idx): both files
            missing = [f for f in (prefix_of(p) + e for e in (".bin", ".idx")) if not os.path.isfile(f)]
            if missing:
                raise ConfigError(f"{cfg.source}: data file {missing[0]} does not exist (data.kind = 'indexed' "
                                  "reads PREFIX.bin and PREFIX.idx)")
        elif not os.path.isfile(p):
            raise ConfigError(f"{cfg.source}: data file {p} does not exist")
    if cfg.data.kind in TEXT_KINDS and cfg.data.tokenizer != "bytes" and not os.path.isdir(cfg.data.tokenizer):
        raise ConfigError(f"{cfg.source}: data.tokenizer {cfg.data.tokenizer} is not a directory (a Hugging Face "
                          f"tokenizer saved with save_pretrained), nor 'bytes'")
    m = cfg.model
    if m.kind == "hf" and not os.path.isfile(os.path.join(m.path, "config.json")):
        raise ConfigError(f"{cfg.source}: model.path {m.path or '(empty)'} has no config.json (a model saved with "
                          "save_pretrained)")
    if m.kind == "factory":
        where = m.path.rsplit(":", 1)[0] if ":" in m.path else ""
        if not where or (where.endswith(".py") and not os.path.isfile(where)):
            raise ConfigError(f"{cfg.source}: model.path {m.path!r}: expected FILE.py:FUNCTION of an existing file")
    if m.kind != "gpt" and m.gpt:
        raise ConfigError(f"{cfg.source}: [model.gpt] is for model.kind = 'gpt', not {m.kind!r}")
    r = cfg.checkpoint.resume
    if r not in ("auto", "none") and not os.path.isdir(r):
        raise ConfigError(f"{cfg.source}: checkpoint.resume {r} is not a folder")


def check_document_mask(cfg: Config) -> None:
    """data.document_mask against the data and layout (the model's forward is checked once built)."""
    d = cfg.data
    if not d.document_mask:
        return
    if d.kind not in TEXT_KINDS or d.tokenizer == "bytes" or d.format == "chat":
        raise ConfigError(f"{cfg.source}: data.document_mask finds documents by the EOS a Hugging Face tokenizer "
                          f"puts after each: it needs data.tokenizer to be one (not 'bytes') and data.kind text, "
                          f"jsonl, parquet or hf_dataset; not data.format = 'chat', whose templates may end every "
                          f"turn with that EOS")
    if cfg.layout.cp > 1:
        raise ConfigError(f"{cfg.source}: data.document_mask: context parallelism (layout.cp = {cfg.layout.cp}) "
                          f"takes causal attention only")
