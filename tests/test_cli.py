"""Command-line tools run as subprocesses on a tiny random Qwen3 target + toy tokenizer + random drafter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_jax import bench, text
from dflash_jax.config import TargetConfig
from dflash_jax.drafter import init_drafter
from dflash_jax.model import init_target
from dflash_jax.weights import save_drafter, save_target

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
BLOCK = 8


def run(*args, timeout=600, cwd=REPO):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=env)
    return r


def ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Tiny Qwen3 target with a BPE tokenizer trained on GSM8K questions, and a random drafter."""
    root = tmp_path_factory.mktemp("models")
    tdir, ddir = root / "target", root / "drafter"
    tok = text.build_demo_tokenizer(str(tdir), text.demo_corpus(str(DATA) if DATA.is_dir() else None, 300),
                                    vocab_size=512)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = TargetConfig(family="qwen3", vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False,
                       eos_token_ids=(eos,))
    target = init_target(cfg, seed=0)
    save_target(target, str(tdir))
    drafter = init_drafter(target, num_layers=2, block_size=BLOCK, mask_token_id=tok.convert_tokens_to_ids("<|mask|>"),
                           seed=1, target_layer_ids=(0, 2))
    save_drafter(drafter, str(ddir))
    return str(tdir), str(ddir)


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


def test_generate_without_arguments_runs_demo():
    r = run("infer.generate")
    out = ok(r)
    if bench.reference_paths()[0] is None:
        assert "DEMO MODE" in out and "RANDOMLY INITIALISED" in out
    else:
        assert "embedded reference pair" in out
    assert "speedup:" in out and "tau" in out
    assert "block size auto (" in out and "auto shape: " in out  # the default: the automatic shape, its choice printed


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


# ----------------------------------------------------------------------------------------------
# infer.benchmark
# ----------------------------------------------------------------------------------------------
def _check_report(rep: dict, block: int):
    assert rep["tau"] >= 1.0 and rep["speedup"] > 0
    counts = rep["histogram"]["counts"]
    assert rep["histogram"]["lengths"] == list(range(1, block + 1)) and len(counts) == block
    assert sum(counts) == rep["cycles"] == rep["speculative"]["row_cycles"] > 0
    # tau is the mean of the histogram
    assert abs(sum(k * c for k, c in zip(rep["histogram"]["lengths"], counts)) / sum(counts) - rep["tau"]) < 1e-9
    t, s = rep["target_only"], rep["speculative"]
    assert abs(rep["speedup"] - t["time_per_output_token_s"] / s["time_per_output_token_s"]) < 1e-9
    assert s["decode_tokens"] == sum(k * c for k, c in zip(rep["histogram"]["lengths"], counts))


@pytest.mark.skipif(not DATA.is_dir(), reason="data sets not available")
def test_benchmark_gsm8k(pair, tmp_path):
    t, d = pair
    out_dir = tmp_path / "out"
    out = ok(run("infer.benchmark", "--target", t, "--drafter", d, "--dataset", "gsm8k", "--max-samples", "2",
                 "--max-new-tokens", "8", "--block-size", str(BLOCK), "--out", str(out_dir), "--data-dir", str(DATA)))
    rep = json.loads((out_dir / "report.json").read_text())
    _check_report(rep, BLOCK)
    assert rep["dataset"] == "gsm8k" and rep["num_samples"] == 2 and rep["num_generations"] == 2
    png = out_dir / "acceptance_histogram.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"tau\s+: [\d.]+", out) and re.search(r"speedup\s+: [\d.]+x", out)
    assert "acceptance-length histogram" in out
    assert "identical   : all 2 outputs equal to target-only" in out and rep["first_differences"] == []
    assert all(t["first_difference"] is None for s in rep["samples"] for t in s["turns"])
    # the GSM8K prompt format reached the model: the first prompt's token count matches
    tok = text.load_tokenizer(t)
    q = json.loads(open(DATA / "gsm8k" / "test.jsonl").readline())["question"]
    expect = text.encode_chat(tok, q + "\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert rep["samples"][0]["turns"][0]["prompt_tokens"] == len(expect)


def test_benchmark_prompt_file_multi_turn_batched(pair, tmp_path):
    t, d = pair
    pf = tmp_path / "p.jsonl"
    pf.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "What is 2+2?"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"turns": ["Tell a joke.", "Explain it."]},
    ]) + "\n")
    out_dir = tmp_path / "out"
    ok(run("infer.benchmark", "--target", t, "--drafter", d, "--prompts", str(pf), "--max-new-tokens", "6",
           "--batch-size", "2", "--block-size", "4", "--out", str(out_dir), "--no-plot"))
    rep = json.loads((out_dir / "report.json").read_text())
    _check_report(rep, 4)
    assert rep["num_samples"] == 3 and rep["num_generations"] == 4 and rep["batch_size"] == 2
    turns = rep["samples"][2]["turns"]
    assert len(turns) == 2
    # the second turn's prompt holds the first turn (and its answer) and the new question
    tok = text.load_tokenizer(t)
    assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + len(text.encode_text(tok, "Explain it."))
    assert not (out_dir / "acceptance_histogram.png").exists()


def test_benchmark_bad_inputs(pair, tmp_path):
    t, d = pair
    r = run("infer.benchmark", "--target", t, "--drafter", d, "--dataset", "aime")
    assert r.returncode == 2 and "unknown data set 'aime'" in r.stderr
    r = run("infer.benchmark", "--target", t, "--drafter", d, "--prompts", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run("infer.benchmark", "--target", t, "--drafter", d, "--dataset", "gsm8k", "--temperature", "nan")
    assert r.returncode == 2 and "--temperature must be a finite number" in r.stderr
    r = run("infer.benchmark", "--target", t, "--dataset", "gsm8k")
    assert r.returncode == 2 and "--drafter is required with --target" in r.stderr


@pytest.mark.skipif(not DATA.is_dir() or bench.reference_paths()[1] is None, reason="needs data and the pair")
def test_benchmark_defaults_to_the_embedded_pair_and_checks_block_before_warmup(tmp_path):
    r = run("infer.benchmark", "--dataset", "gsm8k", "--max-samples", "1", "--block-size", "99",
            "--data-dir", str(DATA), cwd=tmp_path)
    assert "using the embedded reference pair" in r.stdout
    assert r.returncode == 2 and "block_size must be in [2, 16] for this drafter, got 99" in r.stderr
    assert "warm-up" not in r.stdout
    r = run("infer.benchmark", "--dataset", "gsm8k", "--max-samples", "1", "--max-new-tokens", "4", "--no-warmup",
            "--block-size", "4", "--no-plot", "--data-dir", str(DATA), cwd=tmp_path)
    ok(r)
    assert json.loads((tmp_path / "runs" / "benchmark" / "gsm8k" / "report.json").read_text())["block_size"] == 4


@pytest.mark.skipif(not DATA.is_dir(), reason="data sets not available")
def test_mt_bench_two_turns_in_statistics(pair):
    """In-process: both MT-Bench turns are generated and counted, the second sees the first answer."""
    from dflash_jax import prompts
    t, d = pair
    tok = text.load_tokenizer(t)
    target, drafter = bench.load_models(t, d)
    samples = prompts.load_dataset_prompts("mt-bench", str(DATA), max_samples=1)
    gk = dict(max_new_tokens=5, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[], seed=0)
    rep = bench.run_benchmark(target, drafter, tok, samples, gen_kwargs=gk, warmup=False, verbose=False)
    assert rep["num_generations"] == 2
    t0, t1 = rep["samples"][0]["turns"]
    assert t0["target_tokens"] == t1["target_tokens"] == 5
    assert rep["target_only"]["decode_tokens"] == 2 * 4  # first token of each turn comes from prefill
    assert sum(rep["histogram"]["counts"]) == rep["cycles"] >= 2 * 1
    first = text.encode_chat(tok, samples[0].chat(0))
    assert t0["prompt_tokens"] == len(first)
    assert t1["prompt_tokens"] > len(first) + len(text.encode_text(tok, samples[0].turns[1]))


# ----------------------------------------------------------------------------------------------
# micro benchmarks (smoke, small configs)
# ----------------------------------------------------------------------------------------------
def test_bench_decode_smoke():
    out = ok(run("infer.bench_decode", "--config", "tiny", "--layers", "2", "--steps", "4", "--copy-mb", "32",
                 "--repeats", "1"))
    assert "layers=2" in out
    assert re.search(r"memory bandwidth: numpy copy [\d.]+ GB/s, jax copy \(fresh output\) [\d.]+ GB/s, "
                     r"jax in-place [\d.]+ GB/s, jax read \(sum\) [\d.]+ GB/s, jax gemv [\d.]+ GB/s", out)
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+[\d.]+$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 8]
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)


@pytest.mark.slow  # a few small compilations per block size
def test_bench_cycle_smoke():
    out = ok(run("infer.bench_cycle", "--config", "tiny", "--layers", "2", "--steps", "4", "--repeats", "1",
                 "--blocks", "4", "16"))
    assert re.search(r"target-only step \(batch 1\): [\d.]+ ms", out)
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+([\d.]+)$",
                      out, re.M)
    assert [int(r[0]) for r in rows] == [4, 16]
    assert all(float(r[2]) > 0 for r in rows)


@pytest.mark.skipif(not DATA.is_dir() or bench.reference_paths()[1] is None, reason="needs data and the pair")
def test_benchmark_sweep_repeats_report_median_and_range(tmp_path):
    out = ok(run("infer.benchmark_sweep", "--sets", "gsm8k:2", "--temperatures", "0", "--blocks", "4",
                 "--trees", "6", "--max-new-tokens", "8", "--repeats", "3", "--no-plot", "--out", str(tmp_path),
                 "--data-dir", str(DATA)))
    rep = json.loads((tmp_path / "sweep.json").read_text())
    assert rep["repeats"] == 3
    v = rep["runs"][0]["blocks"]["4"]
    runs = v["speedup_spread"]["runs"]
    assert len(runs) == 3 and v["speedup"] == pytest.approx(sorted(runs)[1])
    assert (v["speedup_spread"]["min"], v["speedup_spread"]["max"]) == (min(runs), max(runs))
    assert v["identical_outputs"] == 2
    assert rep["blocks"] == ["4", "tree6"] and rep["runs"][0]["blocks"]["tree6"]["identical_outputs"] == 2
    md = (tmp_path / "sweep.md").read_text()
    assert "median of 3 timed passes" in md and f"{v['speedup']:.2f}x ({min(runs):.2f}-{max(runs):.2f})" in md
    assert "pass 3/3" in out
