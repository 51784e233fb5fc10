"""Instruction data: records made tokens with a loss mask, the prompt masked.

``data.format = "chat"``: a record's ``messages`` ([{role, content}, ...]) rendered by the HF
tokenizer's own chat template; only the assistant turns count in the loss. ``"prompt_completion"``:
a record's ``prompt`` then ``completion`` (bytes or an HF tokenizer); only the completion and
the EOS after it (when the tokenizer has one) count.

The assistant turns are found without knowing the template: the conversation is rendered prefix
by prefix, and assistant message i's tokens are those of ``messages[:i+1]`` beyond those of
``messages[:i]`` with the generation prompt (so the end-of-turn tokens that close it count: the
model learns to stop). That holds only for a template whose renderings of the prefixes are
prefixes of the whole conversation's tokens; one that is not (that rewrites earlier turns as the
conversation grows) is refused, naming the record, never guessed at.

A masked token travels in the ordinary token stream as ``~id`` (= -id - 1, negative), so windows
stay int64 tensors and the sampler, the evaluation set and any mix of streams need not know;
``decode`` (``Prepared.batch``) turns a window back into ids and labels of -100."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Iterable, Optional, Tuple

import numpy as np
import torch

from fxmegatron.errors import ConfigError, DataError
from fxmegatron.train import documents
from fxmegatron.train import records as record_files
from fxmegatron.train.token_files import atomic_write, exclusive
from fxmegatron.train.tokens import TokenStream

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100       # the losses' ignore_index (F.cross_entropy's, HF's, the parallel passes')
# Bumped whenever the cache's content for the same inputs would change.
_CACHE_FORMAT = 1
_SIDECAR = "fxmegatron-masked-tokens/1"

Records = Callable[[str], Iterable[Tuple[str, object]]]     # path -> (where, record), in order


def encode(ids: np.ndarray, counted: np.ndarray) -> np.ndarray:
    """The stream's form: ``id`` where the token counts in the loss, ``~id`` where it does not."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.where(np.asarray(counted, dtype=bool), ids, ~ids)


def decode(windows: torch.Tensor, hf: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of windows of ``seq_len + 1`` encoded tokens, -100 where a target does
    not count. The bundled GPT: labels are the next tokens. HF: the model shifts labels itself, so
    labels are the inputs' positions (label j is the target of position j - 1)."""
    ids = torch.where(windows < 0, ~windows, windows)
    x = ids[:, :-1].contiguous()
    if hf:
        return x, torch.where(windows[:, :-1] < 0, IGNORE, x)
    return x, torch.where(windows[:, 1:] < 0, IGNORE, ids[:, 1:])


def counted_targets(windows: torch.Tensor, hf: bool) -> int:
    """How many of the windows' targets count in the loss (HF's first label has no position)."""
    targets = windows[:, 1:-1] if hf else windows[:, 1:]
    return int((targets >= 0).sum())


def check_held_out(batches, hf: bool, where: str) -> None:
    """Every held-out batch has a target that counts: the evaluation set is fixed, so one whose
    every target is a prompt's would make every validation loss 0/0 (NaN). A training batch may
    be so too (only with prompts longer than global_batch x seq_len tokens): its loss is NaN, which
    run.on_nonfinite handles (stop naming the step, or skip its update)."""
    for k, w in enumerate(batches):
        if counted_targets(w, hf) == 0:
            raise DataError(f"{where}: held-out batch {k} ({w.shape[0]} windows of {w.shape[1]} tokens) has no "
                            f"target that counts in the loss, every token being a prompt's: its loss would be "
                            f"NaN; hold out more records (data.valid, data.valid_fraction) or fewer eval.batches")


class RecordFormat:
    """``fmt(record, where) -> (ids, counted)``: a record (a dict, from any source) as token ids and
    a bool mask of those that count in the loss; ``where`` (e.g. ``path:line``) names it in errors."""

    def __init__(self, fmt: str, tokenizer: str, messages_field: str = "messages", prompt_field: str = "prompt",
                 completion_field: str = "completion"):
        if fmt not in FORMATS[1:]:
            raise ConfigError(f"data.format = {fmt!r}: a masked format is one of {', '.join(FORMATS[1:])}")
        if fmt == "chat" and tokenizer == "bytes":
            raise ConfigError("data.format = 'chat' renders conversations with the tokenizer's chat template, and "
                              "data.tokenizer = 'bytes' has none: give a Hugging Face tokenizer folder")
        self.format, self.tokenizer = fmt, os.fspath(tokenizer)
        self.fields = ({"messages_field": messages_field} if fmt == "chat" else
                       {"prompt_field": prompt_field, "completion_field": completion_field})
        self._tok = None

    def describe(self) -> dict:
        return {"format": self.format, **self.fields}

    @property
    def tok(self):
        """The HF tokenizer (loaded once, when a record needs it; None for bytes)."""
        if self._tok is None and self.tokenizer != "bytes":
            self._tok = documents.load_tokenizer(self.tokenizer)
            if self.format == "chat" and not getattr(self._tok, "chat_template", None):
                raise ConfigError(f"data.tokenizer {self.tokenizer}: the tokenizer has no chat template "
                                  f"(chat_template.jinja, or chat_template in tokenizer_config.json), which "
                                  f"data.format = 'chat' renders conversations with")
        return self._tok

    def __call__(self, record, where: str) -> Tuple[np.ndarray, np.ndarray]:
        if not isinstance(record, dict):
            raise DataError(f"{where}: a record must be an object, got {type(record).__name__}")
        ids, counted = self._chat(record, where) if self.format == "chat" else self._prompt_completion(record, where)
        if not counted.any():
            raise DataError(f"{where}: no token of the record counts in the loss (data.format = "
                            f"{self.format!r}): no assistant message, or an empty completion; drop the record")
        return ids, counted

    # --- prompt_completion ---------------------------------------------------------------------

    def _string(self, record: dict, key: str, where: str) -> str:
        name = self.fields[key]
        value = record.get(name)
        if not isinstance(value, str):
            raise DataError(f"{where}: the record has no string field {name!r} (data.{key}); it has {sorted(record)}")
        return value

    def _prompt_completion(self, record: dict, where: str):
        prompt = self._string(record, "prompt_field", where)
        completion = self._string(record, "completion_field", where)
        tok = self.tok
        if tok is None:
            p, c = list(prompt.encode("utf-8")), list(completion.encode("utf-8"))
        else:
            # tokenized apart, so that no token straddles the boundary between what is masked and
            # what is learnt; no BOS/EOS from the tokenizer (as for text), its EOS after the completion
            p, c = (tok(s, add_special_tokens=False, verbose=False)["input_ids"] for s in (prompt, completion))
            c = list(c) + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        return np.asarray(list(p) + list(c), dtype=np.int64), np.arange(len(p) + len(c)) >= len(p)

    # --- chat ------------------------------------------------------------------------------------

    def _messages(self, record: dict, where: str) -> list:
        name = self.fields["messages_field"]
        msgs = record.get(name)
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: the record has no non-empty list field {name!r} (data.messages_field); "
                            f"it has {sorted(record)}")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: message {j} must be an object with string 'role' and 'content', got "
                                f"{json.dumps(m)[:200]}")
            if m["role"] not in ROLES:
                raise DataError(f"{where}: message {j} has role {m['role']!r}; a role is one of {', '.join(ROLES)}")
        if msgs[0]["role"] == "assistant":
            raise DataError(f"{where}: message 0 is the assistant's: a conversation starts with a system or user "
                            f"message (its prompt is what the template renders before the first answer)")
        return msgs

    def _render(self, conversations: list, generation_prompt: bool, where: str) -> list:
        from jinja2 import TemplateError
        tok = self.tok      # outside the try: a tokenizer without a template is the config's error
        try:
            out = tok.apply_chat_template(conversations, add_generation_prompt=generation_prompt, tokenize=True,
                                               return_dict=True, tokenizer_kwargs={"verbose": False})
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise DataError(f"{where}: the chat template of {self.tokenizer} cannot render the conversation "
                            f"({type(e).__name__}: {e})") from e
        return [list(ids) for ids in out["input_ids"]]

    def _chat(self, record: dict, where: str):
        msgs = self._messages(record, where)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        # one batched call per flag: the prefixes through each answer, and the whole conversation...
        ends = self._render([msgs[:i + 1] for i in turns] + [msgs], False, where)
        full = ends.pop()
        # ...and the prefixes before each answer, with the header that opens an answer
        starts = self._render([msgs[:i] for i in turns], True, where) if turns else []
        counted = np.zeros(len(full), dtype=bool)
        done = 0
        for i, a, b in zip(turns, starts, ends):
            if b[:len(a)] != a:
                self._unstable(where, f"messages[:{i}] with the generation prompt does not render as the start of "
                                      f"messages[:{i + 1}]")
            if full[:len(b)] != b:
                self._unstable(where, f"messages[:{i + 1}] does not render as the start of the whole conversation")
            if len(a) < done:
                self._unstable(where, f"the answer of message {i} starts before the previous answer ends")
            counted[len(a):len(b)] = True
            done = len(b)
        return np.asarray(full, dtype=np.int64), counted

    def _unstable(self, where: str, what: str):
        raise DataError(f"{where}: the chat template of {self.tokenizer} is not prefix-stable: {what}, so the "
                        f"assistant's tokens cannot be told from the prompt's")


# --- the stream --------------------------------------------------------------------------------

def _file_tokens(fmt: RecordFormat, records: Records, path: str) -> np.ndarray:
    parts = [encode(*fmt(rec, where)) for where, rec in records(path)]
    return np.concatenate(parts).astype("<i4") if parts else np.zeros(0, dtype="<i4")


def _cache_key(paths: list, fmt: RecordFormat) -> str:
    desc = {"masked_format": _CACHE_FORMAT, "files_and_tokenizer": documents.cache_key(paths, fmt.tokenizer),
            "records": fmt.describe()}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _read_cache(bin_path: str) -> Optional[np.ndarray]:
    try:
        with open(bin_path + ".json") as f:
            meta = json.load(f)
        if meta.get("format") != _SIDECAR or os.path.getsize(bin_path) != 4 * meta["tokens"]:
            return None
        return np.memmap(bin_path, dtype="<i4", mode="r")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cached(paths: list, fmt: RecordFormat, records: Records, cache_dir: str) -> Optional[np.ndarray]:
    """The encoded stream of ``paths``, written once per host to ``cache_dir/masked-KEY.i32``
    (int32: the masked ids are negative) with its sidecar written last, as documents.py does."""
    os.makedirs(cache_dir, exist_ok=True)
    bin_path = os.path.join(cache_dir, f"masked-{_cache_key(paths, fmt)}.i32")
    arr = _read_cache(bin_path)
    if arr is not None:
        return arr
    with exclusive(bin_path + ".lock"):
        arr = _read_cache(bin_path)      # another rank may have written it meanwhile
        if arr is not None:
            return arr
        count = 0

        def write(f):
            nonlocal count
            for p in paths:
                part = _file_tokens(fmt, records, p)
                part.tofile(f)
                count += len(part)

        atomic_write(bin_path, write)
        if count == 0:
            os.remove(bin_path)
            return None
        side = {"format": _SIDECAR, "dtype": "int32", "tokens": count, "records": fmt.describe(),
                "files": [os.path.abspath(p) for p in paths], "tokenizer": os.path.abspath(fmt.tokenizer)}
        atomic_write(bin_path + ".json", lambda f: f.write(json.dumps(side, indent=1).encode()))
    return _read_cache(bin_path)


def masked_tokens(paths, fmt: RecordFormat, records: Records, cache_dir: Optional[str] = None,
                  kind: str = "jsonl") -> TokenStream:
    """Files of records as one packed stream of encoded tokens (``encode``), each record's tokens
    after the previous one's, in file and record order. ``records(path)`` yields ``(where, record)``
    (``documents.jsonl_records`` for JSON Lines). With ``cache_dir`` and an HF tokenizer the stream is
    written once per host and memory-mapped after (the key: the files, the tokenizer folder and
    the format's fields); by bytes it is built in memory, as plain JSON Lines is."""
    paths = documents.check_text_paths(paths, kind)
    name = documents.paths_name(paths)
    try:
        if cache_dir is not None and fmt.tokenizer != "bytes":
            parts = [_cached(paths, fmt, records, os.fspath(cache_dir))]
        else:
            parts = [_file_tokens(fmt, records, p) for p in paths]
    except OSError as e:
        raise DataError(f"{cache_dir}: cannot read or write the token cache there: {e}") from e
    if not any(p is not None and len(p) for p in parts):
        raise DataError(f"{name}: the files hold no records")
    return TokenStream([p for p in parts if p is not None], name=name)


def jsonl_masked_tokens(paths, fmt: RecordFormat, cache_dir: Optional[str] = None) -> TokenStream:
    return masked_tokens(paths, fmt, documents.jsonl_records, cache_dir)


# each record kind's reader of whole records: path -> (where, record), in order
ROW_READERS = {"jsonl": documents.jsonl_records, "parquet": record_files.parquet_rows,
               "hf_dataset": record_files.dataset_rows}


def record_masked_tokens(kind: str, paths, fmt: RecordFormat, cache_dir: Optional[str] = None) -> TokenStream:
    """``masked_tokens`` of JSON Lines, Parquet or ``datasets`` folders (``kind``), a row's columns
    being its record's fields."""
    return masked_tokens(paths, fmt, ROW_READERS[kind], cache_dir, kind)


def record_format(data) -> RecordFormat:
    """The config's ``[data]`` section's format (not ``"text"``)."""
    return RecordFormat(data.format, data.tokenizer, data.messages_field, data.prompt_field, data.completion_field)

