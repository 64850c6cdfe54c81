"""Benchmark prompt sets: loading (local JSON Lines first, the hub's `datasets` second) and the
DFlash paper's prompt formats.

A `PromptSample` is a conversation to continue: optional preset `history` messages, then one or
more user `turns`. Turn k is generated from history + (user turn i, assistant answer i for i < k) +
user turn k; single-turn sets have one turn, MT-Bench has two.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Keep its signature and docstring, and reply with the whole "
    "function in a single ```python code block.\n\n```python\n{prompt}\n```"
)
MBPP_TEMPLATE = (
    "Write a Python function for the task below. Your code must pass the tests shown; reply with the "
    "function in a single ```python code block.\n\nTask: {text}\n\nTests:\n```python\n{tests}\n```"
)


@dataclasses.dataclass
class PromptSample:
    id: str
    turns: list[str]  # user turns, in order
    history: list[dict] = dataclasses.field(default_factory=list)  # preset messages before turn 0
    dataset: str = ""

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def chat(self, turn: int, answers: Sequence[str] = ()) -> list[dict]:
        """Messages for generating turn `turn`, given the assistant answers to earlier turns."""
        if not 0 <= turn < len(self.turns):
            raise IndexError(f"sample {self.id} has {len(self.turns)} turn(s), asked for turn {turn}")
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier answer(s), got {len(answers)}")
        msgs = [dict(m) for m in self.history]
        for i in range(turn):
            msgs.append({"role": "user", "content": self.turns[i]})
            msgs.append({"role": "assistant", "content": answers[i]})
        msgs.append({"role": "user", "content": self.turns[turn]})
        return msgs


# ----------------------------------------------------------------------------------------------
# Per-data-set formats
# ----------------------------------------------------------------------------------------------
def _need(row: dict, *names: str) -> Any:
    for n in names:
        if n in row and row[n] is not None:
            return row[n]
    raise ValueError(f"row has none of the fields {names}; it has {sorted(row)}")


def format_gsm8k(row: dict) -> list[str]:
    return [str(_need(row, "question")).strip() + MATH_SUFFIX]


def format_math500(row: dict) -> list[str]:
    return [str(_need(row, "problem")).strip() + MATH_SUFFIX]


def format_humaneval(row: dict) -> list[str]:
    return [HUMANEVAL_TEMPLATE.format(prompt=str(_need(row, "prompt")).rstrip())]


def format_mbpp(row: dict) -> list[str]:
    text = str(_need(row, "prompt", "text")).strip()
    tests = row.get("test_list") or []
    if isinstance(tests, str):
        tests = [tests]
    return [MBPP_TEMPLATE.format(text=text, tests="\n".join(str(t) for t in tests))]


def format_mt_bench(row: dict) -> list[str]:
    turns = _need(row, "turns", "prompt")  # local file: turns; hub (HuggingFaceH4/mt_bench_prompts): prompt
    if isinstance(turns, str):
        turns = [turns]
    turns = [str(t) for t in turns]
    if not turns:
        raise ValueError("MT-Bench row has no turns")
    return turns


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    files: tuple[str, ...]  # candidate files under the data dir, first existing wins
    hub: tuple[str, str | None, str]  # (hub id, config, split) for `datasets.load_dataset`
    format: Callable[[dict], list[str]]
    id_field: str | None = None


DATASETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec("gsm8k", ("gsm8k/test.jsonl",), ("openai/gsm8k", "main", "test"), format_gsm8k),
    "math500": DatasetSpec("math500", ("math500/test.jsonl",), ("HuggingFaceH4/MATH-500", None, "test"),
                           format_math500, "unique_id"),
    "humaneval": DatasetSpec("humaneval", ("humaneval/HumanEval.jsonl",), ("openai/openai_humaneval", None, "test"),
                             format_humaneval, "task_id"),
    "mbpp": DatasetSpec("mbpp", ("mbpp/sanitized-mbpp.json", "mbpp/mbpp.jsonl"),
                        ("google-research-datasets/mbpp", "sanitized", "test"), format_mbpp, "task_id"),
    "mt-bench": DatasetSpec("mt-bench", ("mt_bench/question.jsonl",), ("HuggingFaceH4/mt_bench_prompts", None, "train"),
                            format_mt_bench, "question_id"),
}
_ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "math-500": "math500", "math_500": "math500",
            "human-eval": "humaneval", "human_eval": "humaneval", "gsm-8k": "gsm8k"}


def canonical_name(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(DATASETS)} (or pass --prompts FILE.jsonl)")
    return key


def default_data_dir() -> str | None:
    """$DFLASH_DATA_DIR when set, else ../shared/data beside the repository when it exists, else None."""
    env = os.environ.get("DFLASH_DATA_DIR")
    if env:
        return env
    repo = Path(__file__).resolve().parent.parent
    cand = repo.parent / "shared" / "data"
    return str(cand) if cand.is_dir() else None


def read_records(path: str, locations: bool = False):
    """Rows of a JSON Lines file, or of a .json file holding a list of objects (or an object with
    the list under "data", "rows" or "examples"). Bad JSON is a ValueError naming file and line.

    With `locations`, returns (rows, where) with where[k] = "line N" (JSON Lines, counting from 1 as
    editors do) or "record N" (a JSON list, from 1), for error messages about row k."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON ({e.msg})") from None
            if isinstance(data, dict):
                data = next((data[k] for k in ("data", "rows", "examples") if isinstance(data.get(k), list)), data)
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected a JSON list of objects")
            rows = data
            where = [f"record {k}" for k in range(1, len(rows) + 1)]
        else:
            rows, where = [], []
            for k, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{k}: invalid JSON ({e.msg}) at line {k}") from None
                where.append(f"line {k}")
    for r, w in zip(rows, where):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: {w} is a {type(r).__name__}, expected a JSON object")
    return (rows, where) if locations else rows


def _hub_rows(spec: DatasetSpec, max_samples: int | None) -> list[dict]:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise FileNotFoundError("the `datasets` library is not installed") from None
    hub_id, config, split = spec.hub
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline / missing
        msg = " ".join(str(e).split())  # one line
        raise FileNotFoundError(f"could not load {hub_id} from the hub: {type(e).__name__}: {msg}") from None
    n = len(ds) if max_samples is None else min(len(ds), max_samples)
    return [dict(ds[i]) for i in range(n)]


def how_to_get(name: str) -> str:
    """Where a data set comes from and the two ways to get it, in one sentence (the loader's error ends with it)."""
    spec = DATASETS[canonical_name(name)]
    hub_id, config, split = spec.hub
    return (f"The prompt sets are public data on the Hugging Face hub ({hub_id}{f' {config}' if config else ''}, "
            f"split {split}): pip install \"dflash-jax[hub]\" to fetch it from there, or save its rows at DIR/{spec.files[0]} "
            f"(JSON Lines or a JSON list), DIR being --data-dir, $DFLASH_DATA_DIR or ../shared/data beside the repository")


def load_dataset_prompts(name: str, data_dir: str | None = None, max_samples: int | None = None,
                         allow_hub: bool = True) -> list[PromptSample]:
    """Formatted prompts of a paper data set: a local file under `data_dir` when present, else the hub."""
    key = canonical_name(name)
    spec = DATASETS[key]
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    data_dir = data_dir if data_dir is not None else default_data_dir()
    rows = None
    tried = []
    if data_dir:
        for rel in spec.files:
            p = os.path.join(data_dir, rel)
            tried.append(p)
            if os.path.exists(p):
                rows = read_records(p)
                break
    if rows is None:
        where = ", ".join(tried) if tried else "no data dir"
        if not allow_hub:
            raise FileNotFoundError(f"data set {key}: no local file ({where}). {how_to_get(key)}")
        try:
            rows = _hub_rows(spec, max_samples)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"data set {key}: no local file ({where}) and the hub fallback failed ({e}). "
                                    f"{how_to_get(key)}") from None
    if max_samples is not None:
        rows = rows[:max_samples]
    out = []
    for k, row in enumerate(rows):
        try:
            turns = spec.format(row)
        except ValueError as e:
            raise ValueError(f"data set {key}, row {k}: {e}") from None
        rid = row.get(spec.id_field) if spec.id_field else None
        out.append(PromptSample(id=str(rid if rid is not None else k), turns=turns, dataset=key))
    return out


def load_prompt_file(path: str, max_samples: int | None = None) -> list[PromptSample]:
    """A JSON Lines file (or JSON list) of objects with "prompt" (string), "messages" (a chat list
    ending with a user message) or "turns" (list of user turns); an optional "id"."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt file {path} does not exist")
    rows, locs = read_records(path, locations=True)
    if max_samples is not None:
        rows = rows[:max_samples]
    out = []
    for k, row in enumerate(rows):
        where = f"{path}: {locs[k]}"
        rid = str(row.get("id", k))
        if "messages" in row:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
            for m in msgs:
                if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                    raise ValueError(f"{where}: every message needs a 'role' and a string 'content'")
            if msgs[-1]["role"] != "user":
                raise ValueError(f"{where}: the last message must have role 'user', got {msgs[-1]['role']!r}")
            out.append(PromptSample(id=rid, turns=[msgs[-1]["content"]],
                                    history=[{"role": m["role"], "content": m["content"]} for m in msgs[:-1]],
                                    dataset="prompts"))
        elif "turns" in row:
            turns = row["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
            out.append(PromptSample(id=rid, turns=list(turns), dataset="prompts"))
        elif "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            out.append(PromptSample(id=rid, turns=[row["prompt"]], dataset="prompts"))
        else:
            raise ValueError(f"{where}: needs a 'prompt', 'messages' or 'turns' field (has {sorted(row)})")
    if not out:
        raise ValueError(f"prompt file {path} holds no prompts")
    return out
