"""Self-distillation data generation: prompt sources and formats, shards, kill/resume, clear errors."""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from dflash_jax import generate, load_target
from dflash_jax.training.config import config_from_dict
from dflash_jax.training.data import committed_shards, data_is_complete, generate_data, load_sequences, split_train_eval
from dflash_jax.training.records import DataError, PromptEncoder, load_prompt_records, record_to_messages
from dflash_jax.training.pipeline import ensure_target
from dflash_jax.training.testing import sigint_at_default, signal_when, tiny_config_dict, write_id_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April. How many clips did she sell?",
    "Weng earns $12 an hour for babysitting. How much did she earn?",
    "Write a Python function that adds two numbers.",
    "What is 7 times 8?",
    "Betty is saving money for a new wallet which costs $100.",
    "James writes a 3-page letter to 2 different friends twice a week.",
    "".join(chr(65 + (i * 7919) % 26) + chr(97 + (i * 104729) % 26) for i in range(300)),  # too long: skipped
]


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chat"))
    with open(f"{root}/q.jsonl", "w") as f:
        for q in QUESTIONS:
            f.write(json.dumps({"question": q, "answer": "42"}) + "\n")
    d = tiny_config_dict(root, data={"prompts": f"{root}/q.jsonl", "field": "question", "prompt_format": "chat",
                                     "max_length": 96, "generation": {"max_new_tokens": 24, "batch_size": 4}})
    cfg = config_from_dict(d)
    ensure_target(cfg, log=lambda *_: None)
    return root, cfg


def test_chat_generation_writes_prompt_and_target_response(chat_setup):
    root, cfg = chat_setup
    prog = generate_data(cfg, progress=False)
    assert prog["complete"] and prog["total"] == len(QUESTIONS) and prog["done"] == len(QUESTIONS)
    assert data_is_complete(cfg)
    metas = [json.load(open(b + ".json")) for b in committed_shards(cfg.data.output_dir)]
    assert len(metas) == 2 and sum(len(m["skipped"]) for m in metas) == 1  # the 400-char prompt
    data = load_sequences(cfg.data.output_dir)
    assert data.ids.tolist() == [0, 1, 2, 3, 4, 5]
    from dflash_jax.text import load_tokenizer
    tok = load_tokenizer(cfg.target.path)
    target = load_target(cfg.target.path)
    for i in range(len(data)):
        q = QUESTIONS[data.ids[i]]
        want_prompt = tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        seq = data.seq(i).tolist()
        assert data.prompt_lens[i] == len(want_prompt) and seq[:len(want_prompt)] == want_prompt
        assert tok.convert_tokens_to_ids("<|im_start|>") in want_prompt
    # the response is the target's own greedy continuation (same prompt, same settings)
    p = data.seq(2)[:data.prompt_lens[2]].tolist()
    ref = generate(target, None, [p], max_new_tokens=24, stop_token_ids=[tok.eos_token_id], row_ids=[2])
    assert data.seq(2)[len(p):].tolist() == ref.tokens[0]
    # a second call has nothing to do
    again = generate_data(cfg, progress=False)
    assert again["sequences"] == 6 and len(committed_shards(cfg.data.output_dir)) == 2
    # raw format: the text only, no chat markers
    raw = config_from_dict(yaml.safe_load(cfg.to_yaml()), ["data.prompt_format=raw"])
    ids = PromptEncoder(raw).encode({"question": QUESTIONS[0]})
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ids and tok.decode(ids) == QUESTIONS[0]


def test_changed_settings_are_refused(chat_setup):
    root, cfg = chat_setup
    generate_data(cfg, progress=False)
    other = config_from_dict(yaml.safe_load(cfg.to_yaml()), ["data.generation.temperature=0.7"])
    with pytest.raises(DataError, match=r"different settings \(differs in: generation\)"):
        generate_data(other, progress=False)
    assert not data_is_complete(other)
    # more prompts later: only the new ones are generated
    more = config_from_dict(yaml.safe_load(cfg.to_yaml()), ["data.max_prompts=3"])
    assert not data_is_complete(more)


def test_chat_format_needs_a_template(chat_setup, tmp_path):
    root, cfg = chat_setup
    tok_dir = tmp_path / "tok"
    shutil.copytree(cfg.target.path, tok_dir)
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tc))
    bad = config_from_dict(yaml.safe_load(cfg.to_yaml()), [f"target.tokenizer={tok_dir}"])
    with pytest.raises(DataError, match="no chat template; set data.prompt_format=raw"):
        PromptEncoder(bad)
    ok = config_from_dict(yaml.safe_load(cfg.to_yaml()), [f"target.tokenizer={tok_dir}", "data.prompt_format=raw"])
    assert PromptEncoder(ok).encode({"question": "hi"})


def test_record_formats():
    assert record_to_messages({"q": "hello"}, "q") == [{"role": "user", "content": "hello"}]
    assert record_to_messages({"turns": ["a", "b"]}, "turns") == [{"role": "user", "content": "a"}]
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert record_to_messages({"messages": conv}, "messages") == conv[:2]
    sg = [{"from": "human", "value": "hey"}, {"from": "gpt", "value": "yo"}]
    assert record_to_messages({"conversations": sg}, "conversations") == [{"role": "user", "content": "hey"}]
    al = record_to_messages({"instruction": "Sort", "input": "3 1 2"}, "instruction")
    assert al == [{"role": "user", "content": "Sort\n\n3 1 2"}]
    assert record_to_messages({"q": "x"}, "q", "be brief")[0] == {"role": "system", "content": "be brief"}
    with pytest.raises(DataError, match="no user turn"):
        record_to_messages({"m": [{"role": "assistant", "content": "x"}]}, "m")
    with pytest.raises(DataError, match="expected text"):
        record_to_messages({"q": 3}, "q")


def test_prompt_source_errors(tmp_path):
    base = tiny_config_dict(str(tmp_path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cfg = config_from_dict(base, [f"data.prompts={empty}"])
    with pytest.raises(DataError, match="has no records"):
        load_prompt_records(cfg.data)
    cfg = config_from_dict(base, [f"data.prompts={tmp_path}/missing.jsonl"])
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_records(cfg.data)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"ids": [1, 2]}\n{oops\n')
    cfg = config_from_dict(base, [f"data.prompts={broken}"])
    with pytest.raises(DataError, match=r"\.jsonl:2: invalid JSON .* at line 2"):
        load_prompt_records(cfg.data)
    try:
        import datasets  # noqa: F401
    except ImportError:
        cfg = config_from_dict(base, ["data.prompts=someorg/some-prompts"])
        with pytest.raises(DataError, match=r"needs the `datasets` package"):
            load_prompt_records(cfg.data)
    write_id_prompts(str(tmp_path / "p.jsonl"), 3)
    cfg = config_from_dict(base, [f"data.prompts={tmp_path}/p.jsonl", "data.field=prompt"])
    with pytest.raises(DataError, match=r"data.field 'prompt' is not in the prompt records"):
        PromptEncoder(cfg).encode({"ids": [1]})
    cfg = config_from_dict(base, [f"data.prompts={tmp_path}/p.jsonl"])
    with pytest.raises(DataError, match="prompt_format=ids needs a list of token ids"):
        PromptEncoder(cfg).encode({"ids": "text"})


def test_empty_or_unusable_data_dirs(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_sequences(str(tmp_path / "nope"))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"no data shards"):
        load_sequences(str(tmp_path / "d"))
    np.save(tmp_path / "d" / "shard_000000.npy", np.zeros((0,), np.int32))
    (tmp_path / "d" / "shard_000000.json").write_text(json.dumps(
        {"ids": [], "prompt_lens": [], "lengths": [], "finished": [], "skipped": [0], "covered": [0]}))
    with pytest.raises(DataError, match="hold no sequences"):
        load_sequences(str(tmp_path / "d"))
    from dflash_jax.training.data import SequenceData
    short = SequenceData.from_lists([[1, 2, 3], [4, 5, 6, 7]], [3, 3])
    with pytest.raises(DataError, match="no sequence has a response of at least 2 tokens"):
        split_train_eval(short, 0)


def _ids_cfg(root, out):
    return tiny_config_dict(root, data={"output_dir": out, "generation": {"batch_size": 6, "max_new_tokens": 20}})


def test_generation_killed_midway_resumes_without_loss_or_duplicates(tmp_path):
    root = str(tmp_path)
    write_id_prompts(f"{root}/prompts.jsonl", 30, seed=5)
    # uninterrupted reference
    ref_cfg = config_from_dict(_ids_cfg(root, f"{root}/ref"))
    ensure_target(ref_cfg, log=lambda *_: None)
    generate_data(ref_cfg, progress=False)
    ref = load_sequences(ref_cfg.data.output_dir)
    # killed run
    d = _ids_cfg(root, f"{root}/killed")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    env = dict(os.environ, DFLASH_GEN_CHUNK_DELAY="3", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "train.generate_data", "--config", str(cfg_path), "--no-progress"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    signal_when(proc, lambda: os.path.exists(f"{root}/killed/shard_000001.json"), "shard written", 240)
    assert proc.returncode == -signal.SIGKILL
    assert not json.load(open(f"{root}/killed/progress.json"))["complete"]
    n_before = len(committed_shards(f"{root}/killed"))
    assert 2 <= n_before < 5
    # a crash between a shard's .npy and its .json leaves an orphan .npy: it must be ignored and replaced
    np.save(f"{root}/killed/shard_{n_before:06d}.npy", np.full((7,), 9, np.int32))
    out = subprocess.run([sys.executable, "-m", "train.generate_data", "--config", str(cfg_path), "--no-progress"],
                         cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "30/30 prompts done" in out.stdout
    got = load_sequences(f"{root}/killed")
    assert got.ids.tolist() == list(range(30)) == ref.ids.tolist()  # no loss, no duplicates
    for i in range(30):
        assert np.array_equal(got.seq(i), ref.seq(i)), i
        assert got.prompt_lens[i] == ref.prompt_lens[i]
    prog = json.load(open(f"{root}/killed/progress.json"))
    assert prog["complete"] and prog["sequences"] == 30 and prog["tokens"] == int(ref.lengths.sum())


def test_ctrl_c_in_data_generation_is_one_line_and_resumes(tmp_path):
    root = str(tmp_path)
    write_id_prompts(f"{root}/prompts.jsonl", 18, seed=6)
    d = _ids_cfg(root, f"{root}/int")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    cmd = [sys.executable, "-m", "train.generate_data", "--config", str(cfg_path), "--no-progress"]
    env = dict(os.environ, DFLASH_GEN_CHUNK_DELAY="3", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=sigint_at_default)
    # SIGINT 1 s after the first shard's index appears: inside the 3-s pause after that shard, so its progress
    # line has been printed (sent at once, it could land between the index and the line, as seen under CI)
    signal_when(proc, lambda: os.path.exists(f"{root}/int/shard_000000.json"), "shard written", 240,
                settle=1.0, sig=signal.SIGINT)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert re.search(r"^interrupted; data generation: (6|12)/18 prompts done", err, re.M), err[-3000:]
    assert f"in {root}/int; no training checkpoint yet; run the same command to resume" in err
    assert re.search(r"^generate: 6/18 prompts, 6 sequences, \d+ tokens", out, re.M), out  # --no-progress: a line
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "18/18 prompts done" in done.stdout
    assert load_sequences(f"{root}/int").ids.tolist() == list(range(18))


def test_interrupted_report_counts_committed_shards_not_a_trailing_progress_file(tmp_path):
    """progress.json is rewritten just after each shard: a Ctrl-C between the two still reports the shard."""
    from dflash_jax.training import cli
    from types import SimpleNamespace
    out = tmp_path / "int"
    out.mkdir()
    (out / "progress.json").write_text(json.dumps({"total": 18, "done": 0, "complete": False}))
    (out / "shard_000000.json").write_text(json.dumps({"ids": [0, 1, 2], "prompt_lens": [1, 1, 1], "lengths": [3, 3, 3],
                                                        "finished": [1, 1, 1], "skipped": [4], "covered": [0, 1, 2, 4]}))
    cfg = SimpleNamespace(data=SimpleNamespace(output_dir=str(out)),
                          checkpoint=SimpleNamespace(dir=str(tmp_path / "ckpt")))
    assert cli._where(cfg) == f"data generation: 4/18 prompts done in {out}; no training checkpoint yet"
    (out / "progress.json").write_text(json.dumps({"total": 18, "done": 18, "complete": True}))
    assert cli._where(cfg) == "no training checkpoint yet"
