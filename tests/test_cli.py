"""Command-line tools (infer.generate, train, help texts) run as subprocesses on a tiny random Qwen3 target +
toy tokenizer + random drafter (tests/cli_common.py); the benchmark tools: tests/test_cli_bench.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_jax import text
from dflash_jax.training.testing import sigint_at_default
from tests.cli_common import REPO, make_pair, ok, run


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("models"))


def _prompt_tokens(out: str) -> int:
    return int(re.search(r"prompt: (\d+) tokens", out).group(1))


# ----------------------------------------------------------------------------------------------
# infer.generate
# ----------------------------------------------------------------------------------------------
def test_generate_with_drafter_compares_by_default(pair):
    t, d = pair
    out = ok(run("infer.generate", "--target", t, "--drafter", d, "--prompt", "What is 7 times 6?",
                 "--max-new-tokens", "12", "--block-size", "4"))
    assert "=" * 30 + " output " + "=" * 30 in out
    m = re.search(r"\[dflash B=4\] (\d+) tokens, decode ([\d.]+) tok/s .* tau ([\d.]+) over (\d+) cycles", out)
    assert m, out
    assert 1 <= int(m.group(1)) <= 12 and float(m.group(2)) > 0 and 1.0 <= float(m.group(3)) <= 4.0
    assert re.search(r"\[target-only\] \d+ tokens, decode [\d.]+ tok/s", out)
    sp = re.search(r"speedup: ([\d.]+)x", out)
    assert sp and float(sp.group(1)) > 0
    assert "DEMO MODE" not in out


def test_generate_target_only_and_raw_prompt(pair):
    t, _ = pair
    out = ok(run("infer.generate", "--target", t, "--prompt", "What is 7 times 6?", "--max-new-tokens", "6",
                 "--no-chat-template", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3",
                 "--no-warmup"))
    assert "[target-only]" in out and "tau" not in out and "speedup" not in out
    tok = text.load_tokenizer(t)
    assert _prompt_tokens(out) == len(text.encode_chat(tok, "What is 7 times 6?", use_chat_template=False))


def test_generate_no_compare_and_template_fallback(pair, tmp_path):
    t, d = pair
    # a tokenizer directory without a chat template: raw text with a warning
    (tmp_path / "tokenizer.json").write_text(Path(t, "tokenizer.json").read_text())
    cfg = json.loads(Path(t, "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = run("infer.generate", "--target", t, "--drafter", d, "--tokenizer", str(tmp_path), "--prompt", "Hi there",
            "--max-new-tokens", "5", "--no-compare", "--no-warmup", "--block-size", "8")
    out = ok(r)
    assert "no chat_template" in r.stderr
    assert "[dflash B=8]" in out and "[target-only]" not in out and "speedup" not in out
    tok = text.load_tokenizer(t)
    assert _prompt_tokens(out) == len(text.encode_text(tok, "Hi there"))


def test_generate_bad_inputs(pair, tmp_path):
    t, d = pair
    r = run("infer.generate", "--target", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run("infer.generate", "--target", t, "--drafter", d, "--block-size", "99", "--max-new-tokens", "4")
    assert r.returncode == 2 and "block_size must be in [2, 8]" in r.stderr
    r = run("infer.generate", "--drafter", d)
    assert r.returncode == 2 and "--drafter needs --target" in r.stderr


def test_generate_prints_its_prompt_and_the_median_speedup_of_repeats(pair):
    t, d = pair
    out = ok(run("infer.generate", "--target", t, "--drafter", d, "--prompt", "What is 7 times 6?",
                 "--prompt-format", "math", "--max-new-tokens", "8", "--block-size", "4", "--repeats", "3"))
    assert "prompt (math format, in the chat template):\n  What is 7 times 6?\n  Please reason step by step" in out
    assert "block size 4\n" in out
    rounds = re.search(r"speedup per round: ([\d.]+)x, ([\d.]+)x, ([\d.]+)x", out)
    med = re.search(r"speedup: ([\d.]+)x \(median of 3 rounds, range ([\d.]+)-([\d.]+)x;", out)
    assert rounds and med, out
    sp = sorted(float(x) for x in rounds.groups())
    assert float(med.group(1)) == pytest.approx(sp[1], abs=1e-3)
    assert (float(med.group(2)), float(med.group(3))) == pytest.approx((sp[0], sp[2]), abs=1e-3)
    assert "acceptance-length histogram (cycles that committed 1, 2, ..., 4 tokens): [" in out
    # a user's prompt goes as typed unless asked otherwise: fewer tokens than with the math line
    raw = ok(run("infer.generate", "--target", t, "--prompt", "What is 7 times 6?", "--max-new-tokens", "2",
                 "--no-warmup"))
    assert "prompt (raw format, in the chat template):\n  What is 7 times 6?\n" in raw
    assert _prompt_tokens(raw) < _prompt_tokens(out)


def test_generate_caps_max_new_tokens_at_the_context(pair, tmp_path):
    t, _ = pair
    small = tmp_path / "small"
    small.mkdir()
    for f in os.listdir(t):
        (small / f).write_bytes(Path(t, f).read_bytes())
    cfg = json.loads((small / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (small / "config.json").write_text(json.dumps(cfg))
    r = run("infer.generate", "--target", str(small), "--prompt", "What is 7 times 6?", "--max-new-tokens", "100000",
            "--no-warmup", "--repeats", "1")
    out = ok(r)
    n = _prompt_tokens(out)
    assert f"note: --max-new-tokens 100000 capped to {48 - n}: the prompt ({n} tokens)" in r.stderr
    got = int(re.search(r"\[target-only\] (\d+) tokens", out).group(1))
    assert 1 <= got <= 48 - n


def test_generate_rejects_bad_arguments_before_loading(pair, tmp_path):
    t, d = pair
    cases = [
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--target", str(tmp_path / "nope")], f"--target directory {tmp_path / 'nope'} does not exist"),
        (["--target", t, "--compare"], "--compare needs a drafter"),
        (["--target", t, "--drafter", str(tmp_path / "gone")], "--drafter directory"),
    ]
    for argv, msg in cases:
        r = run("infer.generate", *argv)
        assert r.returncode == 2 and msg in r.stderr, (argv, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_ctrl_c_exits_with_one_line_and_status_130(pair):
    """Ctrl-C (SIGINT) while generate compiles or decodes: the line "interrupted" on stderr, no traceback, no crash of
    the runtime's teardown (dflash_jax.cli.run), status 130."""
    t, d = pair
    p = subprocess.Popen([sys.executable, "-m", "infer.generate", "--target", t, "--drafter", d, "--prompt",
                          "What is 7 times 6?", "--max-new-tokens", "64", "--block-size", "4", "--repeats", "50"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), preexec_fn=sigint_at_default)
    try:
        seen = []
        for line in p.stdout:  # printed (flushed) just before the warm-up compiles and the timed rounds
            seen.append(line)
            if line.startswith("block size"):
                break
        assert p.poll() is None, "".join(seen)
        time.sleep(2)  # inside the warm-up's compiles or the decode
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, (p.returncode, err[-3000:])
    assert err.strip().splitlines() == ["interrupted"], err[-3000:]


def test_cli_help_texts_are_whole():
    h = ok(run("infer.bench_decode", "--help"))
    assert "against the measured memory bandwidth of this machine." in " ".join(h.split())
    h = ok(run("infer.bench_sharding", "--help"))
    assert h.startswith("usage: python -m infer.bench_sharding")


def test_train_outside_the_repo_writes_nothing_before_failing(tmp_path):
    r = run("train", "--config", str(REPO / "configs" / "tiny_cpu.yaml"), cwd=tmp_path)
    assert r.returncode == 2
    assert "data.prompts file ../shared/data/gsm8k/train.jsonl does not exist (relative paths are read from " \
           f"the working directory {tmp_path})" in r.stderr
    assert os.listdir(tmp_path) == []
