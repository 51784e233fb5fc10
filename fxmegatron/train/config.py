"""The trainer's config file: one TOML file, every key declared here with its type, default and
meaning (``docs/TRAINER.md`` is written from this table; a test checks they agree).

Checking happens before any process group work, so a mistake ends the job with one line
naming the key: an unknown or mistyped key (with the closest known one), a value of the
wrong type or outside its choices, a missing required key, a layout that does not fit the
world size, a file that does not exist.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from fxmegatron.errors import ConfigError
from fxmegatron.layout import CP_ATTENTIONS, PRECISIONS, RECOMPUTE_MODES, SCHEDULE_NAMES
from fxmegatron.ops.fp8 import RECIPES
from fxmegatron.ops.overlapped_linear import TRANSPORTS
from fxmegatron.runtime.sharded_dp import DP_SHARD_MODES
from fxmegatron.train.mixture import check_mix

try:                            # Python 3.11+
    import tomllib
except ImportError:             # pragma: no cover - Python 3.10
    import tomli as tomllib     # type: ignore[no-redef]

REQUIRED = object()
TEXT_KINDS = ("text", "jsonl", "parquet", "hf_dataset")     # data kinds read through a tokenizer (bytes or a folder)


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    types: Tuple[type, ...]
    default: Any
    doc: str
    choices: Optional[Tuple[Any, ...]] = None
    minimum: Optional[float] = None

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


def _k(section, name, types, default, doc, choices=None, minimum=None):
    types = types if isinstance(types, tuple) else (types,)
    return Key(section, name, types, default, doc, choices, minimum)


STR, INT, FLOAT, BOOL, LIST = str, int, (int, float), bool, (str, list)
# layout.compile: a bool or one of torch.compile's mode names (torch._inductor.list_mode_options)
COMPILE_CHOICES = (False, True, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
INTS = (list,)          # a list of whole numbers
NAMES = (list, str)     # a name or a list of strings (not LIST: no paths)
TABLES = (list, tuple)  # a list of tables (TOML never gives tuples: the pair only tells it apart from INTS)

KEYS: List[Key] = [
    # ---- run ----
    _k("run", "out", STR, "runs/train", "output folder: loss.csv, TensorBoard events, loss.png, checkpoints/"),
    _k("run", "steps", INT, REQUIRED, "optimizer steps to train for", minimum=1),
    _k("run", "seed", INT, 0, "seed of the initial weights, the data order and dropout"),
    _k("run", "device", STR, "auto", "cpu, cuda (a GPU per process on each host, else an error), or auto (cuda when "
       "there is a GPU per process, cpu when there is none; some but too few is an error)",
       choices=("auto", "cpu", "cuda")),
    _k("run", "precision", STR, "fp32", "fp32, or bf16 (bf16 parameters, fp32 master weights and moments in "
       "FusedAdamW, fp32 gradient accumulation over microbatches)", choices=("fp32", "bf16")),
    _k("run", "on_nonfinite", STR, "stop", "a NaN/inf loss or gradient norm: stop the run naming the step, or "
       "skip that step's update", choices=("stop", "skip")),
    _k("run", "check_replicas_every", INT, 0, "compare the ranks' copies of every replicated weight (tp, dp, "
       "pipeline-tied) every N steps, and always before a checkpoint is written: copies that parted stop the run, "
       "named (0: before checkpoints only)", minimum=0),
    _k("run", "watchdog_s", FLOAT, 600.0, "a rank that makes no progress within a step for this many seconds "
       "ends the whole job, naming the rank and where it stood", minimum=1),
    _k("run", "first_step_s", FLOAT, 1800.0, "the same allowance for the first step (compilation happens there)",
       minimum=1),
    _k("run", "log_every", INT, 0, "when stdout is not a terminal: a progress line every N steps "
       "(0: steps / 10)", minimum=0),
    _k("run", "peak_tflops", FLOAT, 0.0, "peak TFLOP/s per device for the MFU column (0: H100/H200 bf16 "
       "dense 989 on cuda, none on cpu)", minimum=0),
    # ---- model ----
    _k("model", "kind", STR, "gpt", "gpt (the bundled GPT), hf (a Hugging Face causal LM saved with "
       "save_pretrained, read offline), or factory (FILE.py:FN returning a model)",
       choices=("gpt", "hf", "factory")),
    _k("model", "path", STR, "", "hf: the model's directory; factory: FILE.py:FN"),
    _k("model", "weights", STR, "load", "hf: load the folder's safetensors weights, or random (its config.json "
       "alone, each rank initialising its own shards: pre-training from scratch)", choices=("load", "random")),
    _k("model", "gpt", dict, {}, "kind = gpt: GPTConfig fields (n_layer, n_head, n_embd, dropout, "
       "tie_embeddings, bias; vocab_size and block_size come from the data)"),
    _k("model", "init_from", STR, "", "start from these weights: a trainer checkpoint folder (with index.json, "
       "any layout) or a model folder (fxmegatron export, save_pretrained) holding exactly the model's parameters; "
       "step 0, a fresh optimizer, this run's data and layout (empty: none). A checkpoint of this run that "
       "checkpoint.resume takes wins"),
    # ---- data ----
    _k("data", "kind", STR, "text", "text (plain text files, tokenized: a file is a document), jsonl (JSON "
       "Lines: each record's text_field is a document), tokens (a flat .bin file of token ids, nanoGPT's "
       "convention), indexed (Megatron's PREFIX.bin + PREFIX.idx from preprocess_data.py; give PREFIX), parquet "
       "(Parquet files: each row's text_field is a document) or hf_dataset (folders written by datasets' "
       "save_to_disk, one split's folder each: each row's text_field is a document)",
       choices=("text", "jsonl", "tokens", "indexed", "parquet", "hf_dataset")),
    _k("data", "text_field", STR, "text", "kind = jsonl, parquet or hf_dataset: the field (column) of each record "
       "that holds its text"),
    _k("data", "format", STR, "text", "kind = jsonl, parquet or hf_dataset: what a record (row) is: text (its text_field, every token in the "
       "loss), chat (its messages_field, [{role, content}, ...], rendered by the tokenizer's chat template; only "
       "the assistant turns in the loss) or prompt_completion (prompt_field then completion_field; only the "
       "completion and EOS in the loss)", choices=("text", "chat", "prompt_completion")),
    _k("data", "messages_field", STR, "messages", "format = chat: the field of each record that holds its messages"),
    _k("data", "prompt_field", STR, "prompt", "format = prompt_completion: the field holding the prompt"),
    _k("data", "completion_field", STR, "completion", "format = prompt_completion: the field holding the completion"),
    _k("data", "document_mask", BOOL, False, "Hugging Face models and tokenizers: attention kept inside each "
       "packed document (a per-document causal mask, positions restarting at each document, its first token "
       "not predicted from the document before): each document computed as alone. Its mask leaves the flash "
       "kernels on GPUs"),
    _k("data", "train", LIST, [], "training file(s): a path or a list of paths (give train or mix)"),
    _k("data", "mix", TABLES, [], "a weighted mixture of training corpora in place of train: [{path = \"a\", "
       "weight = 0.7}, ...], each a file (folder, prefix) of data.kind; weights positive, normalised; samples "
       "interleaved as Megatron's BlendedDataset, each corpus in its own epochs"),
    _k("data", "valid", LIST, [], "held-out file(s); when empty, the last valid_fraction of the training "
       "tokens is held out"),
    _k("data", "valid_fraction", FLOAT, 0.1, "share of the training tokens held out when valid is empty",
       minimum=0),
    _k("data", "token_dtype", STR, "uint16", "kind = tokens: uint16 or uint32", choices=("uint16", "uint32")),
    _k("data", "tokenizer", STR, "bytes", "kind = text, jsonl, parquet or hf_dataset: bytes (UTF-8 bytes, "
       "vocabulary 256) or the directory "
       "of a Hugging Face tokenizer (save_pretrained form)"),
    _k("data", "seq_len", INT, REQUIRED, "tokens per sequence (sequences are packed: documents concatenated)",
       minimum=1),
    _k("data", "global_batch", INT, REQUIRED, "sequences per optimizer step, over all data-parallel ranks",
       minimum=1),
    # ---- layout ----
    _k("layout", "dp", INT, 1, "data-parallel replicas", minimum=1),
    _k("layout", "pp", INT, 1, "pipeline stages", minimum=1),
    _k("layout", "cp", INT, 1, "context parallelism: the sequence split over cp ranks (each holds two "
       "load-balanced chunks of 2·cp; data.seq_len must be divisible by 2·cp; no dropout)", minimum=1),
    _k("layout", "cp_attention", STR, "ring", "cp > 1: how attention exchanges keys and values, ring (P2P "
       "around the cp ranks) or allgather", choices=CP_ATTENTIONS),
    _k("layout", "tp", INT, 1, "tensor-parallel ranks", minimum=1),
    _k("layout", "sequence_parallel", BOOL, False, "norms, dropout and residuals on sequence shards (tp > 1)"),
    _k("layout", "recompute", STR, "none", "activation recomputation", choices=RECOMPUTE_MODES),
    _k("layout", "virtual_stages", INT, 1, "model chunks per pipeline rank (interleaved 1F1B)", minimum=1),
    _k("layout", "microbatches", INT, 1, "microbatches per step and data-parallel rank", minimum=1),
    _k("layout", "schedule", STR, "", "gpipe, 1f1b or interleaved (empty: 1f1b, interleaved with "
       "virtual_stages > 1)", choices=("",) + SCHEDULE_NAMES),
    _k("layout", "fuse", BOOL, False, "fxmegatron's generated Triton kernels for elementwise chains"),
    _k("layout", "compile", (bool, str), False, "torch.compile each rank's graph (not with fuse): true, or one of "
       "torch.compile's modes (reduce-overhead: CUDA graphs, which FP8 at tp >= 2 needs to pay, docs/FP8.md)",
       choices=COMPILE_CHOICES),
    _k("layout", "tp_comm_overlap", INT, 0, "with sequence_parallel: cut each tensor-parallel all-gather and "
       "reduce-scatter into this many pieces overlapped with the matmuls (0: off; GPU)", minimum=0),
    _k("layout", "overlap", INT, 0, "the first name of tp_comm_overlap, still read (give one of the two)",
       minimum=0),
    _k("layout", "tp_comm_transport", STR, "auto", "what moves tp_comm_overlap's pieces: copy_engine (the GPU's "
       "copy engines, symmetric memory), nccl (the process group), or auto (copy engines where the group has "
       "them)", choices=TRANSPORTS),
    _k("layout", "blocks_per_chunk", INTS, [], "transformer blocks of each pipeline chunk, pp x virtual_stages "
       "numbers (empty: balanced by cost)"),
    _k("layout", "precision", STR, "bf16", "the linear layers' matmuls: bf16 (in the parameters' dtype, "
       "run.precision) or fp8 (FP8 GEMMs with dynamic scales; sm_89+ on GPU, emulated on CPU)", choices=PRECISIONS),
    _k("layout", "fp8_recipe", STR, "tensorwise", "precision = fp8: the scaling recipe, tensorwise or rowwise",
       choices=tuple(sorted(RECIPES))),
    _k("layout", "fp8_policy", NAMES, "all", "precision = fp8: the linears in FP8, all, attention, mlp, or a "
       "list of module-path regexes"),
    _k("layout", "dp_shard", STR, "none", "what the data-parallel (and cp) ranks shard: none, optimizer (the "
       "optimizer's state, ZeRO-1), gradients (the gradients too, reduce-scattered every microbatch, ZeRO-2) "
       "or full (the parameters, gradients and state, ZeRO-3); "
       "needs optim.fused",
       choices=DP_SHARD_MODES),
    _k("layout", "dp_replicate", INT, 1, "hybrid sharding (HSDP): the dp ranks split into this many groups, "
       "each sharding as dp_shard says over its own dp / dp_replicate ranks, the groups replicas of each other "
       "(a multi-node job: shard inside a node, replicate across)", minimum=1),
    _k("layout", "ep", INT, 1, "expert parallelism, folded onto the data-parallel ranks: each ep consecutive dp "
       "ranks hold E/ep whole experts of every mixture-of-experts block and compute them for the tokens of all "
       "ep (docs/EXPERT_PARALLEL.md); dp must be a multiple of ep", minimum=1),
    _k("layout", "moe_capacity_factor", FLOAT, 0, "an MoE capacity factor cf: each expert keeps at most "
       "ceil(cf * T * k / E) of the (token, slot) assignments of a rank's tokens, those of the largest routing "
       "weights, the others' combine weight 0 (docs/EXPERT_PARALLEL.md); 0: dropless", minimum=0),
    # ---- optim ----
    _k("optim", "lr", FLOAT, 3e-4, "peak learning rate", minimum=0),
    _k("optim", "min_lr", FLOAT, 3e-5, "learning rate at the end of the decay", minimum=0),
    _k("optim", "warmup_steps", INT, 0, "linear warmup from 0 to lr", minimum=0),
    _k("optim", "decay", STR, "cosine", "after warmup: cosine or linear to min_lr at the last step, "
       "constant, or wsd (constant, then linear to min_lr over the last wsd_fraction of the steps)",
       choices=("cosine", "linear", "constant", "wsd")),
    _k("optim", "wsd_fraction", FLOAT, 0.2, "decay = wsd: share of the steps spent decaying", minimum=0),
    _k("optim", "weight_decay", FLOAT, 0.1, "decoupled weight decay, on matrices only (not on biases, norms "
       "or any other parameter of fewer than 2 dims)", minimum=0),
    _k("optim", "beta1", FLOAT, 0.9, "AdamW's beta1", minimum=0),
    _k("optim", "beta2", FLOAT, 0.95, "AdamW's beta2", minimum=0),
    _k("optim", "eps", FLOAT, 1e-8, "AdamW's eps", minimum=0),
    _k("optim", "grad_clip", FLOAT, 1.0, "clip the whole model's gradient norm to this (0: no clipping)",
       minimum=0),
    _k("optim", "fused", BOOL, True, "fxmegatron's FusedAdamW (fp32 masters; one kernel on GPU) rather "
       "than torch.optim.AdamW"),
    # ---- eval ----
    _k("eval", "every", INT, 0, "evaluate on the held-out split every N steps and at the end (0: only at "
       "the end)", minimum=0),
    _k("eval", "batches", INT, 2, "held-out global batches per evaluation (always the same ones)", minimum=1),
    # ---- checkpoint ----
    _k("checkpoint", "dir", STR, "", "checkpoint folder (empty: OUT/checkpoints)"),
    _k("checkpoint", "every", INT, 0, "save every N steps (0: only at the end and at SIGTERM)", minimum=0),
    _k("checkpoint", "keep", INT, 3, "keep the last K checkpoints", minimum=1),
    _k("checkpoint", "resume", STR, "auto", "auto (the latest complete checkpoint in dir, if any), none, or "
       "a checkpoint folder"),
    # ---- log ----
    _k("log", "tensorboard", BOOL, True, "write TensorBoard event files to OUT/tensorboard"),
    _k("log", "plot", BOOL, True, "write OUT/loss.png at the end"),
    _k("log", "dump", STR, "", "a folder: after parallelize every rank writes its transformed graph(s), "
       "placements, plan and collectives to DUMP/rankN (fxmegatron train --dump DIR sets it); empty: no dump"),
    _k("log", "jsonl", BOOL, False, "also write OUT/log.jsonl: loss.csv's rows as JSON lines (one object per step, "
       "floats exact), rewritten on resume as loss.csv is"),
    _k("log", "wandb", BOOL, False, "also log every row to Weights & Biases from rank 0, in OUT/wandb (needs the "
       "wandb package: pip install 'fxmegatron[wandb]'); a resumed job is a new W&B run in the same group"),
    _k("log", "wandb_project", STR, "fxmegatron", "log.wandb: the W&B project"),
    _k("log", "wandb_mode", STR, "offline", "log.wandb: offline (written to OUT/wandb only; upload later with "
       "`wandb sync`) or online", choices=("offline", "online")),
]

SECTIONS = tuple(dict.fromkeys(k.section for k in KEYS))
_BY_PATH = {k.path: k for k in KEYS}


def _closest(word: str, options) -> str:
    near = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _check_value(key: Key, value, where: str):
    if key.types == (dict,) and not isinstance(value, dict):
        raise ConfigError(f"{where}: {key.path} must be a table, got {value!r}")
    ok = isinstance(value, key.types) and not (isinstance(value, bool) and bool not in key.types)
    if not ok:
        want = "a list of whole numbers" if key.types == INTS else "a list of tables" if key.types == TABLES else \
            " or ".join(sorted({"list of strings" if t is list else t.__name__ for t in key.types}))
        raise ConfigError(f"{where}: {key.path} = {value!r} must be {want}")
    if key.types == NAMES and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key.path} must be a name or a list of strings, got {value!r}")
    if key.types == INTS and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{where}: {key.path} must be a list of whole numbers, got {value!r}")
    if key.types == TABLES and not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where}: {key.path} must be a list of tables ([{{...}}, ...]), got {value!r}")
    if key.types == LIST and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key.path} must be a path or a list of paths, got {value!r}")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where}: {key.path} = {value!r} is not one of {', '.join(map(repr, key.choices))}")
    if key.minimum is not None and isinstance(value, (int, float)) and value < key.minimum:
        raise ConfigError(f"{where}: {key.path} = {value!r} must be >= {key.minimum:g}")
    return float(value) if key.types == FLOAT else value


class Config:
    """The checked config: ``cfg.section.name`` (e.g. ``cfg.layout.tp``) and ``cfg.source`` (the
    file). Relative paths in it are relative to the config file's folder."""

    def __init__(self, values: Dict[str, Dict[str, Any]], source: str):
        self.source = source
        self.values = values
        for section, d in values.items():
            setattr(self, section, _Section(d))

    def as_dict(self) -> Dict[str, Dict[str, Any]]:
        return {s: dict(d) for s, d in self.values.items()}


class _Section:
    def __init__(self, d):
        self.__dict__.update(d)


def from_dict(raw: Dict[str, Any], where: str = "config", base_dir: str = ".",
              overrides: Optional[List[str]] = None) -> Config:
    """Check ``raw`` (the parsed TOML) against ``KEYS``; fill in defaults; resolve paths."""
    raw = {s: dict(v) if isinstance(v, dict) else v for s, v in raw.items()}
    for item in overrides or []:
        _apply_override(raw, item, where)
    values: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{where}: unknown section [{section}]{_closest(section, SECTIONS)}; sections: "
                              f"{', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section} must be a table ([{section}])")
        known = [k.name for k in KEYS if k.section == section]
        for name, value in table.items():
            if name not in known:
                raise ConfigError(f"{where}: unknown key {section}.{name}{_closest(name, known)}")
            values[section][name] = _check_value(_BY_PATH[f"{section}.{name}"], value, where)
    for key in KEYS:
        if key.name not in values[key.section]:
            if key.default is REQUIRED:
                raise ConfigError(f"{where}: {key.path} is required ({key.doc})")
            values[key.section][key.name] = (list(key.default) if isinstance(key.default, list)
                                              else dict(key.default) if isinstance(key.default, dict)
                                              else key.default)
    for name in ("train", "valid"):
        v = values["data"][name]
        values["data"][name] = [_path(base_dir, p) for p in ([v] if isinstance(v, str) else v)]
    values["data"]["mix"] = check_mix(values["data"]["mix"], where, lambda p: _path(base_dir, p))
    if bool(values["data"]["train"]) == bool(values["data"]["mix"]):
        raise ConfigError(f"{where}: give exactly one of data.train (training file(s)) and data.mix (a weighted "
                          f"mixture of corpora); " + ("both are set" if values["data"]["train"] else "neither is"))
    for section, name in (("run", "out"), ("checkpoint", "dir"), ("log", "dump")):
        if values[section][name]:
            values[section][name] = _path(base_dir, values[section][name])
    if values["checkpoint"]["resume"] not in ("auto", "none"):
        values["checkpoint"]["resume"] = _path(base_dir, values["checkpoint"]["resume"])
    if not values["checkpoint"]["dir"]:
        values["checkpoint"]["dir"] = os.path.join(values["run"]["out"], "checkpoints")
    if values["layout"]["dp_shard"] != "none" and not values["optim"]["fused"]:
        raise ConfigError(f"{where}: layout.dp_shard = {values['layout']['dp_shard']!r} shards FusedAdamW's state: "
                          "it needs optim.fused = true")
    m = values["model"]
    if m["kind"] == "hf" or (m["kind"] == "gpt" and m["path"]) or (m["kind"] == "factory" and ".py:" in m["path"]):
        m["path"] = _path(base_dir, m["path"])
    if m["init_from"]:
        m["init_from"] = _path(base_dir, m["init_from"])
    d = values["data"]
    if d["format"] != "text" and d["kind"] not in ("jsonl", "parquet", "hf_dataset"):
        raise ConfigError(f"{where}: data.format = {d['format']!r} reads records: it needs data.kind = 'jsonl', "
                          f"'parquet' or 'hf_dataset', not {d['kind']!r}")
    if d["format"] == "chat" and d["tokenizer"] == "bytes":
        raise ConfigError(f"{where}: data.format = 'chat' renders conversations with the tokenizer's chat template, "
                          "and data.tokenizer = 'bytes' has none: give a Hugging Face tokenizer folder")
    if values["data"]["kind"] in TEXT_KINDS and values["data"]["tokenizer"] != "bytes":
        values["data"]["tokenizer"] = _path(base_dir, values["data"]["tokenizer"])
    return Config(values, where)


def _path(base_dir: str, p: str) -> str:
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(base_dir, p))


def _apply_override(raw: dict, item: str, where: str) -> None:
    """``section.key=value`` from the command line; the value is parsed as TOML (strings may be bare)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"override {item!r}: expected section.key=value")
    path, text = item.split("=", 1)
    section, name = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    table = raw.setdefault(section, {})
    *outer, leaf = name.split(".")      # model.gpt.n_layer: a key of a nested table
    for part in outer:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section}.{part} must be a table")
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: {section} must be a table")
    table[leaf] = value


def load(path: str, overrides: Optional[List[str]] = None) -> Config:
    """Read and check the TOML file at ``path`` (``overrides``: ``section.key=value`` strings)."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return from_dict(raw, path, os.path.dirname(os.path.abspath(path)), overrides)


def markdown() -> str:
    """The table of every key, as docs/TRAINER.md shows it."""
    lines = []
    for section in SECTIONS:
        lines += [f"### [{section}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in (k for k in KEYS if k.section == section):
            t = ("number" if k.types == FLOAT else "path or list of paths" if k.types == LIST
                 else "list of numbers" if k.types == INTS else "list of tables" if k.types == TABLES
                 else "string or list of strings" if k.types == NAMES
                 else "table" if k.types == (dict,) else k.types[0].__name__)
            d = "required" if k.default is REQUIRED else repr(k.default).replace("'", '"')
            lines.append(f"| `{k.path}` | {t} | {d} | {k.doc} |")
        lines.append("")
    return "\n".join(lines)
