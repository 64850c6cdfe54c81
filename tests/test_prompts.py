"""Prompt sets (real files under ../shared/data), prompt formats, prompt files, chat rendering."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

from dflash_jax import prompts, text

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"data sets not found at {DATA}")


def _first_rows(rel: str, n: int = 3) -> list[dict]:
    p = DATA / rel
    if p.suffix == ".json":
        return json.loads(p.read_text())[:n]
    with open(p) as f:
        return [json.loads(next(f)) for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Paper data sets
# ----------------------------------------------------------------------------------------------
@needs_data
@pytest.mark.parametrize("name,rel,field", [("gsm8k", "gsm8k/test.jsonl", "question"),
                                            ("math500", "math500/test.jsonl", "problem")])
def test_math_sets_append_boxed_instruction(name, rel, field):
    got = prompts.load_dataset_prompts(name, str(DATA), max_samples=3)
    rows = _first_rows(rel)
    assert len(got) == 3
    for s, row in zip(got, rows):
        assert s.num_turns == 1 and s.dataset == name
        assert s.turns[0] == row[field].strip() + "\nPlease reason step by step, and put your final answer within \\boxed{}."


@needs_data
def test_humaneval_wraps_function_in_instruction():
    got = prompts.load_dataset_prompts("humaneval", str(DATA), max_samples=2)
    rows = _first_rows("humaneval/HumanEval.jsonl", 2)
    for s, row in zip(got, rows):
        t = s.turns[0]
        assert row["prompt"].rstrip() in t
        assert t.lower().startswith("complete the following python function")
        assert "```python" in t
        assert s.id == row["task_id"]


@needs_data
def test_mbpp_shows_task_and_tests():
    got = prompts.load_dataset_prompts("mbpp", str(DATA), max_samples=2)
    rows = _first_rows("mbpp/sanitized-mbpp.json", 2)
    for s, row in zip(got, rows):
        t = s.turns[0]
        assert row["prompt"] in t
        for test in row["test_list"]:
            assert test in t
        assert "write a python function" in t.lower()


@needs_data
def test_mbpp_falls_back_to_full_jsonl(tmp_path):
    (tmp_path / "mbpp").mkdir()
    os.symlink(DATA / "mbpp" / "mbpp.jsonl", tmp_path / "mbpp" / "mbpp.jsonl")  # link, never copy data
    got = prompts.load_dataset_prompts("mbpp", str(tmp_path), max_samples=1)
    row = _first_rows("mbpp/mbpp.jsonl", 1)[0]
    assert row["text"] in got[0].turns[0]
    assert row["test_list"][0] in got[0].turns[0]


@needs_data
def test_mt_bench_has_two_turns_and_builds_history():
    got = prompts.load_dataset_prompts("mt-bench", str(DATA), max_samples=2)
    row = _first_rows("mt_bench/question.jsonl", 1)[0]
    s = got[0]
    assert s.num_turns == 2 and s.turns == row["turns"]
    assert s.chat(0) == [{"role": "user", "content": row["turns"][0]}]
    assert s.chat(1, ["FIRST ANSWER"]) == [
        {"role": "user", "content": row["turns"][0]},
        {"role": "assistant", "content": "FIRST ANSWER"},
        {"role": "user", "content": row["turns"][1]},
    ]
    with pytest.raises(ValueError, match="earlier answer"):
        s.chat(1, [])
    with pytest.raises(IndexError):
        s.chat(2, ["a", "b"])


@needs_data
def test_aliases_and_max_samples():
    assert len(prompts.load_dataset_prompts("MT_Bench", str(DATA), max_samples=4)) == 4
    assert prompts.canonical_name("MATH-500") == "math500"
    assert len(prompts.load_dataset_prompts("gsm8k", str(DATA))) == 1319
    with pytest.raises(ValueError, match="max_samples"):
        prompts.load_dataset_prompts("gsm8k", str(DATA), max_samples=0)


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown data set 'aime'.*gsm8k.*mt-bench"):
        prompts.load_dataset_prompts("aime", "/nonexistent")


def test_missing_file_without_datasets_library(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(FileNotFoundError) as e:
        prompts.load_dataset_prompts("gsm8k", str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg and "datasets" in msg


def test_no_data_dir_says_where_the_sets_come_from(monkeypatch):
    """A clone without ../shared/data and without the `datasets` library: one line naming the hub set and the two
    ways to get it (pip install the hub extra, or a local file under --data-dir / $DFLASH_DATA_DIR)."""
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(prompts, "default_data_dir", lambda: None)
    for name, hub, rel in (("gsm8k", "openai/gsm8k", "gsm8k/test.jsonl"),
                           ("mt-bench", "HuggingFaceH4/mt_bench_prompts", "mt_bench/question.jsonl")):
        with pytest.raises(FileNotFoundError) as e:
            prompts.load_dataset_prompts(name)
        msg = str(e.value)
        assert "\n" not in msg
        for part in (f"data set {name}: no local file (no data dir)", "Hugging Face hub", hub, 'pip install "dflash-jax[hub]"',
                     f"DIR/{rel}", "--data-dir", "$DFLASH_DATA_DIR", "../shared/data"):
            assert part in msg, (part, msg)
    with pytest.raises(FileNotFoundError, match=r"no local file \(/nowhere/gsm8k/test.jsonl\)\. The prompt sets"):
        prompts.load_dataset_prompts("gsm8k", "/nowhere", allow_hub=False)


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path))
    assert prompts.default_data_dir() == str(tmp_path)
    monkeypatch.delenv("DFLASH_DATA_DIR")
    expect = str(DATA) if DATA.is_dir() else None
    assert prompts.default_data_dir() == expect


# ----------------------------------------------------------------------------------------------
# --prompts files
# ----------------------------------------------------------------------------------------------
def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompt_file_kinds(tmp_path):
    p = _write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?"},
        {"id": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"turns": ["Tell a joke.", "Explain it."]},
    ])
    got = prompts.load_prompt_file(p)
    assert [s.num_turns for s in got] == [1, 1, 2]
    assert got[0].chat(0) == [{"role": "user", "content": "What is 2+2?"}]
    assert got[1].id == "chat"
    assert got[1].chat(0) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert got[2].chat(1, ["A joke."])[-1] == {"role": "user", "content": "Explain it."}
    assert len(prompts.load_prompt_file(p, max_samples=2)) == 2


@pytest.mark.parametrize("row,match", [
    ({"text": "x"}, "needs a 'prompt', 'messages' or 'turns'"),
    ({"prompt": ""}, "non-empty string"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "last message must have role 'user'"),
    ({"messages": [{"content": "x"}]}, "'role'"),
    ({"turns": []}, "non-empty list"),
])
def test_prompt_file_errors(tmp_path, row, match):
    p = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(ValueError, match=match) as e:
        prompts.load_prompt_file(p)
    assert "bad.jsonl: line 2:" in str(e.value)  # the bad row is on line 2, counted as editors count


def test_prompt_file_error_locations_count_like_editors(tmp_path):
    """JSON Lines errors name the file's line (blank lines included), JSON lists the record from 1."""
    p = tmp_path / "gaps.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"gaps\.jsonl: line 4: needs a 'prompt'"):
        prompts.load_prompt_file(str(p))
    q = tmp_path / "list.json"
    q.write_text(json.dumps([{"prompt": "a"}, {"prompt": ""}]))
    with pytest.raises(ValueError, match=r"list\.json: record 2: 'prompt' must be a non-empty string"):
        prompts.load_prompt_file(str(q))


def test_prompt_file_invalid_json_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        prompts.load_prompt_file(str(p))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prompts.load_prompt_file(str(tmp_path / "nope.jsonl"))


# ----------------------------------------------------------------------------------------------
# Tokenizer and chat rendering
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = text.build_demo_tokenizer(str(d), text.demo_corpus(str(DATA) if DATA.is_dir() else None, 300),
                                    vocab_size=512)
    return str(d), tok


def test_demo_tokenizer_roundtrip_and_template(demo_tok):
    path, tok = demo_tok
    tok2 = text.load_tokenizer(path)  # AutoTokenizer on the saved directory
    assert tok2.eos_token == "<|im_end|>"
    assert [tok2.convert_tokens_to_ids(t) for t in text.DEMO_SPECIAL_TOKENS] == [0, 1, 2, 3]
    s = "Janet has 16 eggs; she eats 3. How many are left?"
    assert tok2.decode(text.encode_text(tok2, s)) == s
    rendered = text.render_chat(tok2, [{"role": "user", "content": s}])
    assert rendered == f"<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n"
    ids = text.encode_chat(tok2, s)
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> first, one <|im_end|>
    raw = text.encode_chat(tok2, s, use_chat_template=False)
    assert tok2.decode(raw) == s and len(raw) < len(ids)
    assert text.stop_token_ids(tok2) == [2]


def test_missing_chat_template(demo_tok, tmp_path):
    path, _ = demo_tok
    (tmp_path / "tokenizer.json").write_text(Path(path, "tokenizer.json").read_text())
    cfg = json.loads(Path(path, "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = text.load_tokenizer(str(tmp_path))
    assert not text.has_chat_template(tok)
    with pytest.raises(text.ChatTemplateError, match="no-chat-template"):
        text.encode_chat(tok, "hello", strict=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ids = text.encode_chat(tok, "hello")
    assert any("chat_template" in str(x.message) for x in w)
    assert tok.decode(ids) == "hello"


def test_stop_ids_and_decode(demo_tok, tmp_path):
    _, tok = demo_tok
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    class Cfg:
        eos_token_ids = (5, 2)
    assert text.stop_token_ids(tok, Cfg(), str(tmp_path)) == [2, 5, 0]
    ids = text.encode_text(tok, "one two") + [2] + text.encode_text(tok, " three")
    assert text.decode(tok, ids, [2]) == "one two"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text.load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        text.load_tokenizer(str(tmp_path))
