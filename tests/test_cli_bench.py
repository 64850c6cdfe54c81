"""Benchmark command-line tools (infer.benchmark, the sweep, micro benchmarks) run as subprocesses on the tiny
pair of tests/cli_common.py."""
from __future__ import annotations

import json
import re

import pytest

from dflash_jax import text
from dflash_jax.bench.datasets import run_benchmark
from dflash_jax.bench.models import load_models, reference_paths
from tests.cli_common import BLOCK, DATA, make_pair, ok, run


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("models"))


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


@pytest.mark.skipif(not DATA.is_dir() or reference_paths()[1] is None, reason="needs data and the pair")
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
def test_benchmark_without_data_says_where_the_sets_come_from(tmp_path):
    """A clone without ../shared/data (and offline): one error line saying where the sets come from, before any
    model loads."""
    env = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DFLASH_DATA_DIR=str(tmp_path / "none"))
    r = run("infer.benchmark", "--dataset", "gsm8k", "--max-samples", "2", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data set gsm8k: no local file"), r.stderr
    assert "Hugging Face hub (openai/gsm8k" in lines[0] and 'pip install "dflash-jax[hub]"' in lines[0]
    assert "--data-dir" in lines[0] and "../shared/data" in lines[0]


@pytest.mark.skipif(not DATA.is_dir(), reason="data sets not available")
def test_benchmark_fixed_shapes_beside_the_main_one(pair, tmp_path):
    """--fixed-shapes runs each shape on the same prompts beside the main one (with the automatic shape, the
    default, the chains 4 and 8), and prints the main shape beside the best fixed one."""
    t, d = pair
    out = ok(run("infer.benchmark", "--target", t, "--drafter", d, "--dataset", "gsm8k", "--max-samples", "2",
                 "--max-new-tokens", "8", "--block-size", "4", "--fixed-shapes", "8,tree:6", "--no-plot", "--out",
                 str(tmp_path), "--data-dir", str(DATA)))
    rep = json.loads((tmp_path / "report.json").read_text())
    fixed = {f["shape"]: f for f in rep["fixed"]}
    assert set(fixed) == {"B=8", "tree 6"}
    for f in fixed.values():
        assert f["tau"] >= 1.0 and f["speedup"] > 0 and f["identical_outputs"] == 2
    best = max(fixed.values(), key=lambda f: f["speedup"])
    m = re.search(r"^vs fixed    : B=4: tau ([\d.]+) speedup ([\d.]+)x; best fixed: (B=8|tree 6) tau [\d.]+ speedup "
                  r"([\d.]+)x \((B=8|tree 6): .*\); B=4 / best fixed ([\d.]+)$", out, re.M)
    assert m, out
    assert m.group(3) == best["shape"] and float(m.group(4)) == pytest.approx(best["speedup"], abs=1e-3)
    r = run("infer.benchmark", "--target", t, "--drafter", d, "--dataset", "gsm8k", "--fixed-shapes", "auto",
            "--data-dir", str(DATA))
    assert r.returncode == 2 and "--fixed-shapes auto" in r.stderr


def test_auto_against_fixed_line():
    from dflash_jax.bench.datasets import auto_against_fixed
    rep = {"block_size": "auto", "tree_budget": "auto", "tau": 2.5, "speedup": 1.2,
           "speculative": {"auto_choices": {"B=8": 3, "target-only": 1}},
           "fixed": [{"shape": "B=4", "tau": 2.0, "speedup": 1.1}, {"shape": "B=8", "tau": 3.0, "speedup": 1.3}]}
    assert auto_against_fixed(rep) == ("auto (B=8 x3, target-only x1): tau 2.50 speedup 1.200x; best fixed: B=8 tau "
                                       "3.00 speedup 1.300x (B=4: tau 2.00 speedup 1.100x); auto / best fixed 0.92")
    assert auto_against_fixed(dict(rep, fixed=[])) is None


def test_mt_bench_two_turns_in_statistics(pair):
    """In-process: both MT-Bench turns are generated and counted, the second sees the first answer."""
    from dflash_jax import prompts
    t, d = pair
    tok = text.load_tokenizer(t)
    target, drafter = load_models(t, d)
    samples = prompts.load_dataset_prompts("mt-bench", str(DATA), max_samples=1)
    gk = dict(max_new_tokens=5, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[], seed=0)
    rep = run_benchmark(target, drafter, tok, samples, gen_kwargs=gk, warmup=False, verbose=False)
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
                 "--blocks", "4", "16", "--trees", "8", "--prompt-len", "40"))
    assert re.search(r"target-only step \(batch 1\): [\d.]+ ms", out)
    assert "40-token prompts" in out
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+([\d.]+)$",
                      out, re.M)
    assert [int(r[0]) for r in rows] == [4, 16]
    assert all(float(r[2]) > 0 for r in rows)
    # tree, block, rows, ms, ratio, the rounds' range of the ratio, then the parts: draft, build, verify, accept, sum
    trees = re.findall(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)-([\d.]+)" + r"\s+([\d.]+)" * 5
                       + r"\s*$", out, re.M)
    assert [(int(t[0]), int(t[1]), int(t[2])) for t in trees] == [(8, 16, 9)]
    assert 0 < float(trees[0][5]) <= float(trees[0][4]) <= float(trees[0][6])
    parts = [float(x) for x in trees[0][7:]]
    assert parts[2] > 0 and min(parts) >= 0 and abs(sum(parts[:4]) - parts[4]) <= 0.03  # 2-decimal columns


def test_bench_cycle_bad_config_and_prompt_len(tmp_path):
    out = run("infer.bench_cycle", "--config", str(tmp_path / "missing"))
    assert out.returncode == 2 and "unknown config" in out.stderr and "config.json" in out.stderr
    out = run("infer.bench_cycle", "--config", str(tmp_path))  # a folder without config.json
    assert out.returncode == 2 and "no config.json" in out.stderr and "Traceback" not in out.stderr
    out = run("infer.bench_cycle", "--config", "tiny", "--prompt-len", "5000")
    assert out.returncode == 2 and "max_position_embeddings (4096)" in out.stderr


@pytest.mark.skipif(not DATA.is_dir(), reason="data sets not available")
def test_benchmark_sweep_repeats_report_median_and_range(pair, tmp_path):
    t, d = pair  # the tiny pair: small programs (the embedded pair's defaults are checked above)
    out = ok(run("infer.benchmark_sweep", "--target", t, "--drafter", d, "--sets", "gsm8k:2", "--temperatures", "0",
                 "--blocks", "4", "--trees", "6", "--max-new-tokens", "8", "--repeats", "3", "--no-plot", "--out",
                 str(tmp_path), "--data-dir", str(DATA)))
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
