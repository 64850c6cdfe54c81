"""Prompt records for data generation: reading the prompt source (a local JSONL/JSON file or a hub
data set), finding the prompt field, and turning a record into chat messages or token ids.

A record's prompt may be a string, a list of strings (the first is the user turn, as MT-Bench's
`turns`), a list of {role, content} messages, or ShareGPT's {from, value}; with
`data.prompt_format=ids` it is a list of token ids.
"""
from __future__ import annotations

import os

from .config import DataSection, TrainConfig

AUTO_FIELDS = ("messages", "conversations", "conversation", "prompt", "question", "problem", "instruction",
               "input", "query", "text", "turns", "prompt_ids", "input_ids")


class DataError(ValueError):
    """A problem with prompts or generated training data."""


def _read_local(path: str) -> list[dict]:
    from ..prompts import read_records
    try:
        return read_records(path)
    except ValueError as e:
        raise DataError(str(e)) from None


def _read_hub(d: DataSection) -> list[dict]:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(
            f"data.prompts {d.prompts!r} is not a local file, and reading a hub data set needs the "
            f"`datasets` package (pip install datasets) and network access; or point data.prompts at a "
            f"local JSONL file") from None
    from datasets import load_dataset
    try:
        ds = load_dataset(d.prompts, d.subset, split=d.split)
    except Exception as e:  # noqa: BLE001 - offline, missing, gated
        raise DataError(f"could not load hub data set {d.prompts!r} (subset={d.subset!r}, split={d.split!r}): "
                        f"{type(e).__name__}: {e}") from None
    return [dict(r) for r in ds]


def check_prompt_source(d: DataSection) -> bool:
    """True for a local prompt file, False for a hub data set name; a DataError for a local path that
    is missing or a directory (checked before anything is written, so a bad path leaves no files)."""
    src = d.prompts
    if os.path.exists(src):
        if os.path.isdir(src):
            raise DataError(f"data.prompts {src} is a directory; expected a .jsonl/.json file or a hub name")
        return True
    if src.endswith((".jsonl", ".json")) or src.startswith((".", "/")):
        rel = "" if os.path.isabs(src) else f" (relative paths are read from the working directory {os.getcwd()})"
        raise DataError(f"data.prompts file {src} does not exist{rel}")
    return False


def load_prompt_records(d: DataSection) -> list[dict]:
    """Records (dicts) of the prompt source, in order, cut to `max_prompts`."""
    src = d.prompts
    rows = _read_local(src) if check_prompt_source(d) else _read_hub(d)
    if not rows:
        raise DataError(f"data.prompts {src} has no records")
    if d.max_prompts is not None:
        rows = rows[:d.max_prompts]
    return rows


def resolve_field(d: DataSection, record: dict) -> str:
    if d.field:
        if d.field not in record:
            raise DataError(f"data.field {d.field!r} is not in the prompt records (keys: {sorted(record)})")
        return d.field
    for f in AUTO_FIELDS:
        if f in record:
            return f
    raise DataError(f"cannot tell which field holds the prompt (keys: {sorted(record)}); set data.field")


_ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
             "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


def record_to_messages(record: dict, field: str, system_prompt: str | None = None) -> list[dict]:
    """A chat (up to and including the first user turn) from one record.

    Accepts a string, a list of strings (first one = first user turn, as MT-Bench's `turns`),
    a list of {role, content} messages, or ShareGPT's {from, value}. Alpaca-style records with a
    non-empty `input` next to `instruction` get it appended."""
    v = record.get(field)
    msgs: list[dict] = []
    if isinstance(v, str):
        text = v
        if field == "instruction" and isinstance(record.get("input"), str) and record["input"].strip():
            text = f"{v}\n\n{record['input']}"
        msgs = [{"role": "user", "content": text}]
    elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        msgs = [{"role": "user", "content": v[0]}]
    elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        for m in v:
            role = m.get("role", m.get("from"))
            content = m.get("content", m.get("value"))
            role = _ROLE_MAP.get(str(role).lower()) if role is not None else None
            if role is None or not isinstance(content, str):
                raise DataError(f"field {field!r}: message {m!r} has no usable role/content")
            msgs.append({"role": role, "content": content})
            if role == "user":
                break
        if not msgs or msgs[-1]["role"] != "user":
            raise DataError(f"field {field!r}: the conversation has no user turn")
    else:
        raise DataError(f"field {field!r} holds {type(v).__name__} {str(v)[:80]!r}; expected text, a list of "
                        f"turns or a list of messages")
    if system_prompt and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


class PromptEncoder:
    """Turns prompt records into token ids according to `data.prompt_format`."""

    def __init__(self, cfg: TrainConfig, tokenizer=None):
        self.d = cfg.data
        self.tok = tokenizer
        if self.d.prompt_format != "ids" and self.tok is None:
            from ..text import load_tokenizer
            path = cfg.tokenizer_path
            try:
                self.tok = load_tokenizer(path)
            except FileNotFoundError as e:
                raise DataError(f"{e} (set target.tokenizer, or data.prompt_format=ids for token-id prompts)") \
                    from None
        if self.d.prompt_format == "chat" and not getattr(self.tok, "chat_template", None):
            raise DataError(f"the tokenizer at {cfg.tokenizer_path} has no chat template; "
                            f"set data.prompt_format=raw to use the prompt text as is")
        self.field = None

    def encode(self, record: dict) -> list[int]:
        if self.field is None:
            self.field = resolve_field(self.d, record)
        if self.field not in record:
            raise DataError(f"a prompt record has no field {self.field!r} (keys: {sorted(record)})")
        if self.d.prompt_format == "ids":
            v = record[self.field]
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise DataError(f"prompt_format=ids needs a list of token ids in field {self.field!r}, got {v!r:.80}")
            return list(v)
        msgs = record_to_messages(record, self.field, self.d.system_prompt)
        if self.d.prompt_format == "chat":
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                **self.d.chat_template_kwargs)
            return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]
        text = "\n\n".join(m["content"] for m in msgs)
        return [int(i) for i in self.tok(text, add_special_tokens=True)["input_ids"]]
