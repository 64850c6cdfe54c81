"""Benchmark logic behind the `infer/` command-line tools.

- Model resolution: the embedded reference pair when present, else a tiny random demo pair.
- `compare_prompt`: one prompt, target-only and speculative, warmed up, decode-time speedup.
- `run_benchmark`: a prompt set in both modes side by side (multi-turn aware), tau, speedup,
  acceptance-length histogram; `write_report` (report.json + PNG histogram).
- `bench_decode` / `bench_cycle`: target-only decode throughput against memory bandwidth, and the
  cost of one speculative cycle relative to one target step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
from typing import Sequence

import numpy as np

from . import text as textlib
from .prompts import PromptSample

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE_DIR = os.path.join(HERE, "assets", "reference")

# Qwen3-0.6B's shape (random weights are used; only the shape matters for timing).
QWEN3_0P6B = dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                  num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, qk_norm=True, max_position_embeddings=40960)
TINY = dict(family="qwen3", vocab_size=4096, hidden_size=128, intermediate_size=256, num_layers=4,
            num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            tie_word_embeddings=True, qk_norm=True, max_position_embeddings=4096)
BENCH_CONFIGS = {"qwen3-0.6b": QWEN3_0P6B, "tiny": TINY}


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Models: reference pair, demo pair, loading
# ----------------------------------------------------------------------------------------------
def reference_paths() -> tuple[str | None, str | None]:
    t = os.path.join(REFERENCE_DIR, "target")
    d = os.path.join(REFERENCE_DIR, "drafter")
    if os.path.isfile(os.path.join(t, "config.json")):
        return t, (d if os.path.isfile(os.path.join(d, "config.json")) else None)
    return None, None


def build_demo_models(out_dir: str, data_dir: str | None = None, seed: int = 0, hidden: int = 64,
                      layers: int = 4, drafter_layers: int = 2, block_size: int = 8,
                      vocab_size: int = 1024) -> tuple[str, str]:
    """A tiny random Qwen3 target (with a trained BPE tokenizer in its directory) and a random
    drafter, written under `out_dir`/target and `out_dir`/drafter. Outputs are gibberish."""
    from .config import TargetConfig
    from .drafter import init_drafter
    from .model import init_target
    from .weights import save_drafter, save_target

    tdir, ddir = os.path.join(out_dir, "target"), os.path.join(out_dir, "drafter")
    tok = textlib.build_demo_tokenizer(tdir, textlib.demo_corpus(data_dir), vocab_size=vocab_size)
    vocab = -(-len(tok) // 64) * 64
    eos = tuple(textlib.stop_token_ids(tok)) + (tok.convert_tokens_to_ids("<|endoftext|>"),)
    cfg = TargetConfig(family="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rope_theta=1e6,
                       tie_word_embeddings=False, qk_norm=True, max_position_embeddings=8192,
                       eos_token_ids=tuple(dict.fromkeys(eos)))
    target = init_target(cfg, seed=seed)
    save_target(target, tdir)
    taps = tuple(sorted({max(0, min(layers - 1, round(x))) for x in np.linspace(1, layers - 1, drafter_layers)}))
    drafter = init_drafter(target, num_layers=drafter_layers, block_size=block_size,
                           mask_token_id=tok.convert_tokens_to_ids("<|mask|>"), seed=seed + 1, target_layer_ids=taps)
    save_drafter(drafter, ddir)
    return tdir, ddir


def demo_banner() -> str:
    line = "!" * 78
    return (f"{line}\n!! DEMO MODE: no --target given and no embedded reference model found.\n"
            f"!! Using a tiny RANDOMLY INITIALISED Qwen3 target + random drafter + toy tokenizer:\n"
            f"!! the generated text is gibberish and the drafter never learns anything (tau ~ 1).\n"
            f"!! Pass --target /path/to/model [--drafter /path/to/drafter] for real output.\n{line}")


def load_models(target_path: str, drafter_path: str | None, dtype: str = "float32", mesh=None):
    from .weights import load_drafter, load_target
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    target = load_target(target_path, dtype=dtype, mesh=mesh)
    drafter = load_drafter(drafter_path, target, dtype=dtype, mesh=mesh) if drafter_path else None
    return target, drafter


def int_or_auto(v: str):
    """argparse type of --block-size / --tree-budget: an integer or 'auto'."""
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        import argparse
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {v!r}") from None


def add_shape_args(p, tree_auto: bool = True) -> None:
    """--block-size (default auto) and --tree-budget (default the chain; 'auto' too if tree_auto)."""
    p.add_argument("--block-size", type=int_or_auto, default="auto",
                   help="drafter block size N: a chain of N (or the tree's depth with --tree-budget); default "
                        "'auto': target-only, chain or tree, chosen per call from the measured cost curve and the "
                        "acceptance so far")
    p.add_argument("--tree-budget", type=int_or_auto if tree_auto else int, default=None,
                   help="verify a draft tree of this many nodes per cycle (DDTree-style; depth <= block size - 1, "
                        "the drafter's block unless --block-size N) instead of the chain of drafts"
                        + ("; 'auto': as --block-size auto" if tree_auto else ""))


def add_mesh_args(p) -> None:
    """--model-parallel / --data-parallel and the multi-host flags (dflash_jax.distributed)."""
    from .distributed import add_distributed_args
    g = p.add_argument_group("devices")
    g.add_argument("--model-parallel", type=int, default=1, help="tensor-parallel degree (mesh 'model' axis)")
    g.add_argument("--data-parallel", type=int, default=None,
                   help="batch-parallel degree (mesh 'data' axis; default: the remaining devices)")
    add_distributed_args(p)


def check_generation_args(args) -> None:
    """Errors in the CLIs' shared generation flags that need no model, reported before anything loads."""
    import math
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        main_error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        main_error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        main_error(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_new_tokens < 1:
        main_error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if getattr(args, "repeats", 1) < 1:
        main_error(f"--repeats must be >= 1, got {args.repeats}")
    if getattr(args, "batch_size", 1) < 1:
        main_error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.block_size is not None and args.block_size != "auto" and args.block_size < 2:
        main_error(f"--block-size must be >= 2, got {args.block_size}")
    if getattr(args, "tree_budget", None) not in (None, "auto") and args.tree_budget < 1:
        main_error(f"--tree-budget must be >= 1, got {args.tree_budget}")
    for flag in ("target", "drafter", "tokenizer"):
        path = getattr(args, flag, None)
        if path and os.path.isfile(path):
            main_error(f"--{flag} {path} is a file; expected a model directory")
        if path and not os.path.exists(path) and not _looks_like_hub_id(path):
            main_error(f"--{flag} directory {path} does not exist")


def _looks_like_hub_id(path: str) -> bool:
    """'owner/name', which load_target / load_drafter fetch from the hub when online."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def mesh_from_args(args):
    """Initialise jax.distributed when asked; a ('data', 'model') mesh when there is more than one
    device (None on a single device). Non-zero processes print nothing."""
    import jax
    from .distributed import is_main_process, maybe_initialize
    from .sharding import make_mesh
    maybe_initialize(args)
    if not is_main_process():
        sys.stdout = open(os.devnull, "w")
    if jax.device_count() == 1 and args.model_parallel == 1 and args.data_parallel in (None, 1):
        return None
    return make_mesh(args.data_parallel, args.model_parallel)


# ----------------------------------------------------------------------------------------------
# Shared generation helpers
# ----------------------------------------------------------------------------------------------
def cache_len_for(prompt_lens: Sequence[int], max_new_tokens: int, block: int, max_positions: int | None = None) -> int:
    """One cache size for both modes of a batch (same attention cost): prompt bucket + new + block,
    with the new tokens capped by the model's context (`max_positions`) as `generate` caps them."""
    from .generate import CACHE_ALIGN, _bucket, _round_up, capped_new_tokens
    longest = max(prompt_lens)
    if max_positions is not None:
        max_new_tokens = capped_new_tokens(max_positions, longest, max_new_tokens)
    return _round_up(max(_bucket(longest), longest + max_new_tokens + block), CACHE_ALIGN)


@dataclasses.dataclass
class ModeStats:
    """Aggregated over every generate call of one mode."""
    decode_time: float = 0.0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    compile_time: float = 0.0
    generated_tokens: int = 0
    loop_cycles: int = 0
    acceptance_lengths: list = dataclasses.field(default_factory=list)
    calls: int = 0
    shapes: dict = dataclasses.field(default_factory=dict)  # shape label -> calls (what "auto" chose)

    def add(self, r) -> None:
        self.decode_time += r.decode_time
        self.decode_tokens += r.decode_tokens
        self.prefill_time += r.prefill_time
        self.compile_time += r.compile_time
        self.generated_tokens += r.num_generated
        self.loop_cycles += r.cycles
        self.acceptance_lengths.extend(x for row in r.acceptance_lengths for x in row)
        self.calls += 1
        if getattr(r, "auto_reason", None):
            from .autoshape import Shape
            lab = Shape(r.block_size or 1, r.tree_budget).label
            self.shapes[lab] = self.shapes.get(lab, 0) + 1

    @property
    def time_per_output_token(self) -> float:
        return self.decode_time / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else float("nan")

    @property
    def tau(self) -> float:
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else float("nan")

    def histogram(self, block: int) -> list[int]:
        """counts[k-1] = number of (row, cycle) pairs that committed k tokens, k = 1..block."""
        h = [0] * block
        for x in self.acceptance_lengths:
            h[min(max(int(x), 1), block) - 1] += 1
        return h

    def to_json(self) -> dict:
        return {"decode_time_s": self.decode_time, "decode_tokens": self.decode_tokens,
                "tokens_per_second": self.tokens_per_second, "time_per_output_token_s": self.time_per_output_token,
                "prefill_time_s": self.prefill_time, "compile_time_s": self.compile_time,
                "generated_tokens": self.generated_tokens, "loop_cycles": self.loop_cycles,
                "row_cycles": len(self.acceptance_lengths), "tau": self.tau, "generate_calls": self.calls,
                **({"auto_choices": dict(self.shapes)} if self.shapes else {})}


def _gen(target, drafter, prompts, gk: dict, S: int, block_size, row_ids, tree_budget=None):
    from .generate import generate
    spec = drafter is not None
    return generate(target, drafter, prompts, block_size=block_size if spec else None, max_cache_len=S,
                    row_ids=row_ids, tree_budget=tree_budget if spec else None, **gk)


def _shape_args(drafter, block_size, tree_budget):
    """(block_size, tree_budget, Bk) as generate() reads them: "auto" in either is the automatic shape
    (both then "auto"); block "auto" with a tree of N nodes is the drafter's own block (None). Bk: the
    block the histogram counts up to (the drafter's under auto; 1 without a drafter)."""
    if drafter is None:
        return None, None, 1
    if tree_budget == "auto" or (block_size == "auto" and tree_budget is None):
        return "auto", "auto", drafter.config.block_size
    if block_size == "auto":
        block_size = None
    return block_size, tree_budget, block_size or drafter.config.block_size


def verify_width(block, tree_budget) -> int:
    """Cache slots one verification writes: the block, or the tree's root + nodes; with "auto", the
    widest shape auto may choose."""
    from .generate import verify_width as width
    if block == "auto" or tree_budget == "auto":
        from .autoshape import TREE_BUDGETS
        return max(TREE_BUDGETS) + 1
    return width(block, tree_budget)


# ----------------------------------------------------------------------------------------------
# One prompt (infer.generate)
# ----------------------------------------------------------------------------------------------
WARMUP_LOOKS = 6  # compare_prompt with auto: at most this many more untimed warm-up calls (while auto looks)


def compare_prompt(target, drafter, prompt_ids: list[int], *, gen_kwargs: dict, block_size: int | None = None,
                   compare: bool = True, warmup: bool = True, repeats: int = 1, tree_budget: int | None = None) -> dict:
    """Run one prompt speculatively (when a drafter is given) and/or target-only.

    Returns {"spec": GenerationResult | None, "target": GenerationResult | None, "speedup": float | None,
    "speedups": [float, ...]}. Each mode is run once untimed first when `warmup` (compile and first-run
    costs excluded; with auto, until its call is no longer a look nor compiled); then `repeats` timed
    rounds, the two modes alternating within each round, so load drifts hit both alike. "speedup" is the median over the rounds; the results are the first round's
    (outputs are deterministic for a seed, only timings differ)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    block_size, tree_budget, Bk = _shape_args(drafter, block_size, tree_budget)
    S = cache_len_for([len(prompt_ids)], gen_kwargs["max_new_tokens"], verify_width(block_size or Bk, tree_budget),
                      target.config.max_position_embeddings)
    modes = []
    if drafter is not None:
        modes.append(("spec", drafter))
    if drafter is None or compare:
        modes.append(("target", None))
    out = {"spec": None, "target": None, "speedup": None, "speedups": []}
    if warmup:
        for _, d in modes:
            r = _gen(target, d, [prompt_ids], gen_kwargs, S, block_size, None, tree_budget)
            # auto: the untimed warm-up goes on while auto still looks (first run, trees being tried) or its
            # call compiled (up to WARMUP_LOOKS calls): a new shape compiles a program for this call, and a
            # program's first run carries one-time costs (~0.2 s on CPU) that are no more part of the steady
            # speed than its compile time
            for _ in range(WARMUP_LOOKS if block_size == "auto" and d is not None else 0):
                if not r.auto_look and r.compile_time == 0:
                    break
                r = _gen(target, d, [prompt_ids], gen_kwargs, S, block_size, None, tree_budget)
    for _ in range(repeats):
        res = {name: _gen(target, d, [prompt_ids], gen_kwargs, S, block_size, None, tree_budget) for name, d in modes}
        for name in res:
            out[name] = out[name] or res[name]
        if len(res) == 2:
            out["speedups"].append(res["target"].time_per_output_token / res["spec"].time_per_output_token)
    if out["speedups"]:
        out["speedup"] = float(np.median(out["speedups"]))
    return out


# ----------------------------------------------------------------------------------------------
# Prompt-set benchmark (infer.benchmark)
# ----------------------------------------------------------------------------------------------
def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two outputs part (the shorter one's length when one is a prefix
    of the other); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_differences(parts: Sequence[int], total: int) -> str:
    """One line on where speculative outputs part from target-only ones (expected in bf16 and on
    accelerators: a multi-token verify and a one-token step round differently; fp32 on CPU: never)."""
    if not parts:
        return f"all {total} outputs equal to target-only"
    ps = sorted(parts)
    return (f"{total - len(ps)}/{total} outputs equal to target-only; the other {len(ps)} part at output token "
            f"{ps[0]} at the earliest, median {ps[len(ps) // 2]}")


def run_benchmark(target, drafter, tok, samples: Sequence[PromptSample], *, gen_kwargs: dict,
                  block_size: int | None = None, batch_size: int = 1, use_chat_template: bool = True,
                  enable_thinking: bool | None = None, warmup: bool = True, verbose: bool = True,
                  tree_budget: int | None = None) -> dict:
    """Target-only and speculative decoding on the same prompts, batch by batch (the two modes
    alternate per batch, so slow drifts of machine load hit both alike).

    Multi-turn samples: turn k's prompt holds the earlier turns' answers; the target-only answer is
    used as history for both modes (identical at temperature 0 by losslessness), so both modes see
    exactly the same prompts. Every turn counts in the statistics."""
    if drafter is None:
        raise ValueError("the benchmark needs a drafter (--drafter)")
    if not samples:
        raise ValueError("no prompts to benchmark")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    block_size, tree_budget, Bk = _shape_args(drafter, block_size, tree_budget)
    max_new = int(gen_kwargs["max_new_tokens"])

    def encode(msgs):
        return textlib.encode_chat(tok, msgs, use_chat_template=use_chat_template, enable_thinking=enable_thinking)

    st_t, st_s = ModeStats(), ModeStats()
    per_sample = [{"id": s.id, "turns": []} for s in samples]
    same = total = 0
    parts: list[int] = []  # per differing output: the index of its first token that differs
    batches = [list(range(i, min(i + batch_size, len(samples)))) for i in range(0, len(samples), batch_size)]
    first_prompts = [encode(s.chat(0, [])) for s in samples]
    # One cache size for the whole run (grown only if a later turn needs more): the decode loop then
    # compiles once per batch shape instead of once per prompt length.
    W = verify_width(block_size or Bk, tree_budget)
    S_run = cache_len_for([len(p) for p in first_prompts], max_new, W, target.config.max_position_embeddings)
    t_start = time.perf_counter()
    if warmup:
        first = batches[0]
        prompts = [first_prompts[i] for i in first]
        S = S_run
        if verbose:
            log(f"warm-up on batch 0 ({len(first)} prompt(s)), both modes ...")
        _gen(target, None, prompts, gen_kwargs, S, block_size, first)
        _gen(target, drafter, prompts, gen_kwargs, S, block_size, first, tree_budget)
    for bi, idx in enumerate(batches):
        answers: dict[int, list[str]] = {i: [] for i in idx}
        max_turns = max(samples[i].num_turns for i in idx)
        for turn in range(max_turns):
            rows = [i for i in idx if samples[i].num_turns > turn]
            prompts = [first_prompts[i] if turn == 0 else encode(samples[i].chat(turn, answers[i])) for i in rows]
            S_run = S = max(S_run, cache_len_for([len(p) for p in prompts], max_new, W,
                                                 target.config.max_position_embeddings))
            stop = gen_kwargs.get("stop_token_ids")
            rt = _gen(target, None, prompts, gen_kwargs, S, block_size, rows)
            rs = _gen(target, drafter, prompts, gen_kwargs, S, block_size, rows, tree_budget)
            st_t.add(rt)
            st_s.add(rs)
            for k, i in enumerate(rows):
                answers[i].append(textlib.decode(tok, rt.tokens[k], stop or ()))
                ident = rt.tokens[k] == rs.tokens[k]
                part = first_difference(rt.tokens[k], rs.tokens[k])
                same += int(ident)
                if part is not None:
                    parts.append(part)
                total += 1
                acc = rs.acceptance_lengths[k]
                per_sample[i]["turns"].append({
                    "prompt_tokens": len(prompts[k]), "target_tokens": len(rt.tokens[k]),
                    "spec_tokens": len(rs.tokens[k]), "tau": float(np.mean(acc)) if acc else None,
                    "identical": ident, "first_difference": part})
        if verbose:
            log(f"batch {bi + 1}/{len(batches)}: tau so far {st_s.tau:.3f}, speedup so far "
                f"{st_t.time_per_output_token / st_s.time_per_output_token:.3f}x "
                f"({time.perf_counter() - t_start:.1f}s)")
    hist = st_s.histogram(Bk)
    return {
        "num_samples": len(samples),
        "num_generations": total,
        "block_size": block_size if block_size == "auto" else Bk,
        "tree_budget": tree_budget,
        "batch_size": batch_size,
        "tau": st_s.tau,
        "speedup": st_t.time_per_output_token / st_s.time_per_output_token,
        "histogram": {"lengths": list(range(1, Bk + 1)), "counts": hist},
        "cycles": len(st_s.acceptance_lengths),
        "identical_outputs": same,
        "first_differences": parts,
        "target_only": st_t.to_json(),
        "speculative": st_s.to_json(),
        "samples": per_sample,
    }


def format_histogram(counts: Sequence[int], width: int = 40) -> str:
    total = max(sum(counts), 1)
    peak = max(max(counts), 1)
    lines = []
    for k, c in enumerate(counts, 1):
        lines.append(f"  {k:>3} | {'#' * round(width * c / peak):<{width}} {c:>6} ({100 * c / total:5.1f}%)")
    return "\n".join(lines)


def plot_histogram(counts: Sequence[int], path: str, title: str = "") -> bool:
    """Bar chart of acceptance lengths to a PNG; False (with a warning) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed; skipping the histogram plot (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = np.arange(1, len(counts) + 1)
    total = max(sum(counts), 1)
    ax.bar(lengths, np.asarray(counts) / total, color="#3b75af")
    ax.set_xlabel("acceptance length (tokens committed per cycle)")
    ax.set_ylabel("fraction of cycles")
    ax.set_xticks(lengths)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(report: dict, out_dir: str, plot: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"report": os.path.join(out_dir, "report.json")}
    if plot:
        png = os.path.join(out_dir, "acceptance_histogram.png")
        title = (f"{report.get('dataset', '')}  tau={report['tau']:.2f}  speedup={report['speedup']:.2f}x  "
                 f"B={report['block_size']}")
        if plot_histogram(report["histogram"]["counts"], png, title):
            paths["plot"] = png
    report = dict(report, files=paths)
    with open(paths["report"], "w") as f:
        json.dump(report, f, indent=2, default=float)
    return paths


# ----------------------------------------------------------------------------------------------
# Micro benchmarks (infer.bench_decode / infer.bench_cycle)
# ----------------------------------------------------------------------------------------------
def bench_target_config(name: str = "qwen3-0.6b", layers: int | None = None, vocab_size: int | None = None,
                        dtype: str = "float32"):
    """A benchmark target's config: a name of BENCH_CONFIGS, or a Hugging Face config.json (its directory
    or the file, e.g. configs/models/qwen3-8b: the shape of a real model, with random weights)."""
    from .config import TargetConfig, read_config_json
    if name in BENCH_CONFIGS:
        cfg = TargetConfig(dtype=dtype, **BENCH_CONFIGS[name])
    elif os.path.exists(name):
        cfg = TargetConfig.from_hf(read_config_json(name), dtype=dtype)
    else:
        raise ValueError(f"unknown config {name!r}: not one of {', '.join(BENCH_CONFIGS)}, nor a config.json "
                         f"or a directory holding one")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return cfg


def tree_bytes(tree) -> int:
    import jax
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def memory_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """Best-of-`repeats` bandwidths in GB/s on an `nbytes` float32 array.

    numpy_copy: np.copyto into a preallocated array (read + write bytes counted);
    jax_copy: a jitted `x * c` into a fresh output (read + write; includes first-touch page faults
    of the new buffer, which XLA CPU pays on every call); jax_inplace: `x * c` with the input donated
    (read + write, same buffer); jax_read: jnp.sum (read only); jax_gemv: [1, 1024] @ [1024, n/1024]
    (read only: the access pattern of batch-1 weight streaming)."""
    import jax
    import jax.numpy as jnp
    n = max(nbytes // 4 // 1024, 1) * 1024
    out = {}

    def best(f):
        jax.block_until_ready(f())
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t0)
        return min(ts)

    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    out["numpy_copy"] = 2 * a.nbytes / best(lambda: np.copyto(b, a)) / 1e9
    del a, b
    x = jnp.ones((n,), jnp.float32)
    cp = jax.jit(lambda v: v * 1.0001)
    out["jax_copy"] = 2 * x.nbytes / best(lambda: cp(x)) / 1e9
    box = [jnp.ones((n,), jnp.float32)]
    ip = jax.jit(lambda v: v * 1.0001, donate_argnums=(0,))

    def run_inplace():
        box[0] = ip(box[0])
        return box[0]

    out["jax_inplace"] = 2 * x.nbytes / best(run_inplace) / 1e9
    del box
    rd = jax.jit(jnp.sum)
    out["jax_read"] = x.nbytes / best(lambda: rd(x)) / 1e9
    w = x.reshape(1024, n // 1024)
    h = jnp.ones((1, 1024), jnp.float32)
    mv = jax.jit(lambda h, w: h @ w)
    out["jax_gemv"] = x.nbytes / best(lambda: mv(h, w)) / 1e9
    del x, w
    return out


def copy_bandwidth(bw: dict) -> float:
    """The reference 'copy bandwidth': the best of numpy's copy and XLA's in-place update."""
    return max(bw["numpy_copy"], bw["jax_inplace"])


def _random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, length)).tolist()


def time_decode(target, drafter, batch: int, steps: int, prompt_len: int = 32, block_size: int | None = None,
                repeats: int = 2) -> dict:
    """Decode `steps` loop iterations (no stop tokens) at batch `batch`; best of `repeats` runs after the
    compiling one. Returns per-step seconds and the result of the best run."""
    from .generate import generate
    prompts = _random_prompts(batch, prompt_len, target.config.vocab_size)
    kw = dict(max_new_tokens=steps + 1, stop_token_ids=[], block_size=block_size)
    t0 = time.perf_counter()
    first = generate(target, drafter, prompts, **kw)
    compile_s = time.perf_counter() - t0
    best = None
    for _ in range(repeats):
        r = generate(target, drafter, prompts, **kw)
        if best is None or r.decode_time / r.cycles < best.decode_time / best.cycles:
            best = r
    return {"step_s": best.decode_time / max(best.cycles, 1), "cycles": best.cycles, "result": best,
            "first_call_s": compile_s, "compile_s": first.compile_time}


def bench_decode(config_name="qwen3-0.6b", layers=None, vocab_size=None, batch_sizes=(1, 8), steps=32,
                 copy_mb=1024, dtype="float32", repeats=2) -> dict:
    import jax
    from .model import init_target
    cfg = bench_target_config(config_name, layers, vocab_size, dtype)
    log(f"config: {config_name} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}/"
        f"{cfg.num_kv_heads} head_dim={cfg.head_dim} inter={cfg.intermediate_size} vocab={cfg.vocab_size} "
        f"tied={cfg.tie_word_embeddings} dtype={dtype}")
    log(f"jax {jax.__version__} backend={jax.default_backend()} devices={jax.devices()} cpus={os.cpu_count()}")
    t0 = time.perf_counter()
    target = init_target(cfg, seed=0, layout="auto", rng="device")
    jax.block_until_ready(target.params)
    pbytes = tree_bytes(target.params)
    nparams = sum(x.size for x in jax.tree_util.tree_leaves(target.params))
    log(f"init_target: {time.perf_counter() - t0:.1f}s, {nparams / 1e6:.1f}M params, {pbytes / 1e9:.3f} GB")
    log(f"measuring memory bandwidth on a {copy_mb} MB array ...")
    bw = memory_bandwidth(copy_mb * 1024 * 1024)
    copy_bw = copy_bandwidth(bw)
    log("  " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in bw.items()))
    rows = []
    for B in batch_sizes:
        r = time_decode(target, None, B, steps, repeats=repeats)
        S = cache_len_for([32], steps + 1, 1)  # the cache generate() allocates for this run
        kv_bytes = 2 * cfg.num_layers * B * S * cfg.num_kv_heads * cfg.head_dim * target.dtype.itemsize
        stream = pbytes / r["step_s"] / 1e9
        row = {"batch": B, "step_ms": 1e3 * r["step_s"], "tokens_per_s": B / r["step_s"], "steps": r["cycles"],
               "weight_stream_GBps": stream, "with_kv_GBps": (pbytes + kv_bytes) / r["step_s"] / 1e9,
               "ratio_to_copy": stream / copy_bw, "ratio_to_numpy_copy": stream / bw["numpy_copy"],
               "ratio_to_gemv": stream / bw["jax_gemv"],
               "compile_s": r["compile_s"]}
        rows.append(row)
        log(f"  batch {B}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:.2f} tok/s, weight streaming "
            f"{stream:.2f} GB/s = {row['ratio_to_numpy_copy']:.2f} x numpy copy, {row['ratio_to_copy']:.2f} x best copy "
            f"(compile {r['compile_s']:.1f}s)")
    return {"config": dataclasses.asdict(cfg), "param_bytes": pbytes, "bandwidth_GBps": bw, "rows": rows}


def print_decode_table(res: dict) -> None:
    bw = res["bandwidth_GBps"]
    copy_bw = copy_bandwidth(bw)
    log("")
    log(f"parameter bytes per step: {res['param_bytes'] / 1e9:.3f} GB")
    log(f"memory bandwidth: numpy copy {bw['numpy_copy']:.2f} GB/s, jax copy (fresh output) {bw['jax_copy']:.2f} GB/s, "
        f"jax in-place {bw['jax_inplace']:.2f} GB/s, jax read (sum) {bw['jax_read']:.2f} GB/s, "
        f"jax gemv {bw['jax_gemv']:.2f} GB/s  (copies count read + write bytes)")
    log(f"{'batch':>5} {'ms/step':>9} {'tok/s':>8} {'stream GB/s':>12} {'+KV GB/s':>9} "
        f"{'/np-copy':>8} {'/best':>6} {'/gemv':>6}")
    for r in res["rows"]:
        log(f"{r['batch']:>5} {r['step_ms']:>9.1f} {r['tokens_per_s']:>8.2f} {r['weight_stream_GBps']:>12.2f} "
            f"{r['with_kv_GBps']:>9.2f} {r['ratio_to_numpy_copy']:>8.2f} {r['ratio_to_copy']:>6.2f} "
            f"{r['ratio_to_gemv']:>6.2f}")
    log(f"(ratios of the weight-streaming bandwidth (parameter bytes / step time) to: /np-copy the numpy copy, "
        f"/best the best copy ({copy_bw:.2f} GB/s), /gemv the jitted batch-1 matvec's read bandwidth)")


def _drafter_taps(num_target_layers: int, n: int) -> tuple[int, ...]:
    from .config import default_target_layer_ids
    ids = default_target_layer_ids(num_target_layers, n)
    if all(0 <= i < num_target_layers for i in ids) and len(set(ids)) == len(ids):
        return ids
    return tuple(range(min(n, num_target_layers)))


def _cycle_parts(target, drafter, Bk: int):
    """The three stages of `generate._cycle` as separately jitted functions (state is not advanced:
    each call redoes the same work at the same position)."""
    import functools
    import jax
    import jax.numpy as jnp
    from .drafter import append_context, draft_hidden_cached, draft_logits_from_hidden
    from .generate import taps_of
    from .model import forward, lm_head
    from .sampling import SamplingParams, position_keys, sample

    sp = SamplingParams()

    @jax.jit
    def draft(target, drafter, anchor, dcache):
        h = draft_hidden_cached(drafter, target, anchor, dcache, Bk)
        drafts = jnp.argmax(draft_logits_from_hidden(drafter, target, h[:, 1:]), axis=-1).astype(jnp.int32)
        return jnp.concatenate([anchor[:, None], drafts], axis=1)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def verify(target, tcache, block, rows, key):
        start = tcache.lengths
        hT, tc, feats = forward(target, block, tcache, taps_of(drafter))
        logits = lm_head(target, hT)
        j = jnp.arange(Bk, dtype=jnp.int32)
        post = sample(logits, sp, position_keys(key, rows, start[:, None] + 1 + j))
        return post, feats, tc.rollback(start)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def accept(drafter, dcache, out, block, post, feats, gen_len, done, stop_ids, max_new):
        B = block.shape[0]
        j = jnp.arange(Bk, dtype=jnp.int32)
        acc = jnp.sum(jnp.cumprod((block[:, 1:] == post[:, :-1]).astype(jnp.int32), axis=1), axis=1)
        n = acc + 1
        is_stop = jnp.any(post[:, :, None] == stop_ids[:, None, :], axis=-1) & (j[None] < n[:, None])
        has_stop = jnp.any(is_stop, axis=-1)
        n = jnp.where(has_stop, jnp.argmax(is_stop, axis=-1) + 1, n)
        n = jnp.minimum(n, max_new - gen_len)
        n = jnp.where(~done, n, 0).astype(jnp.int32)
        out = jax.vmap(lambda o, p, s: jax.lax.dynamic_update_slice(o, p, (s,)))(out, post, gen_len)
        anchor = post[jnp.arange(B), jnp.maximum(n - 1, 0)]
        start = dcache.lengths
        dc = append_context(drafter, feats, dcache, count=n)
        return anchor, out, dc.rollback(start)

    return draft, verify, accept


def _tree_parts(target, drafter, Bk: int, N: int):
    """`generate._tree_cycle`'s stages as separately jitted functions (state not advanced): the drafter's
    block pass + logits, the tree builder alone on those logits, the verification of the N + 1 tree rows
    (forward under the ancestor mask, lm_head, the target's choice at every node), and the acceptance (walk,
    chain equivalent, the accepted path's K/V moved to contiguous slots)."""
    import functools
    import jax
    from .drafter import draft_hidden_cached, draft_logits_from_hidden
    from .generate import _compact_path, taps_of
    from .model import forward, lm_head
    from .sampling import SamplingParams, position_keys, sample
    from .tree import accept_path, build_tree, chain_equivalent

    sp = SamplingParams()

    @jax.jit
    def draft(target, drafter, anchor, dcache):
        return draft_logits_from_hidden(drafter, target, draft_hidden_cached(drafter, target, anchor, dcache, Bk)[:, 1:])

    build = jax.jit(lambda dl, anchor: build_tree(dl, anchor, N))
    build2 = jax.jit(lambda dl, anchor: build_tree(dl, anchor, N, chunk=TOPK_CHUNK))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def verify(target, tcache, tree, rows, key):
        start = tcache.lengths
        pos = start[:, None] + tree.depth
        hT, tc, feats = forward(target, tree.tokens, tcache, taps_of(drafter), positions=pos, new_mask=tree.ancestors)
        choice = sample(lm_head(target, hT), sp, position_keys(key, rows, pos + 1))
        return choice, feats, tc.rollback(start)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def accept(tcache, tree, choice):
        acc, path = accept_path(tree, choice, Bk - 1)
        chain = chain_equivalent(tree, choice)
        return acc + chain, _compact_path(tcache, tcache.lengths, path, N)

    return draft, build, build2, verify, accept


TOPK_CHUNK = 1024  # the two-stage builder's slice (tree.chunked_top_k), timed beside the default


def _prefilled(target, drafter, prompts, prompt_len: int, steps: int, Bk: int, width: int):
    """A decode state after the prefill of `prompts` (cache for `steps` + 1 new tokens and `width`-slot
    verifications, no stop tokens), for timing a cycle's parts: (state, rows, key, stop ids, max_new)."""
    import jax
    import jax.numpy as jnp
    from .generate import _prefill
    from .sampling import SamplingParams
    batch = len(prompts)
    S = cache_len_for([prompt_len], steps + 1, width)
    max_new = steps + 1
    rows_ids = jnp.arange(batch, dtype=jnp.int32)
    key = jax.random.PRNGKey(0)
    stop = jnp.full((batch, 1), -1, jnp.int32)
    pre = jax.jit(lambda t, d, a, b: _prefill(t, d, a, b, rows_ids, key, stop, jnp.full((batch,), max_new, jnp.int32),
                                              S=S, Bk=Bk, sp=SamplingParams()))
    st = pre(target, drafter, jnp.asarray(np.asarray(prompts, np.int32)), jnp.full((batch,), prompt_len, jnp.int32))
    return st, rows_ids, key, stop, max_new


def _best_time(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bench_cycle(config_name="qwen3-0.6b", layers=None, vocab_size=None, blocks=(4, 8, 16), steps=16,
                drafter_layers=5, dtype="float32", batch=1, repeats=2, trees=(), prompt_len=32,
                layout="auto") -> dict:
    """T_cycle(B) / T_target_step for each block size, and the fused-loop cycle against the sum of
    its separately jitted parts (drafter pass, verify pass, acceptance); for each tree budget N in `trees`,
    the fused-loop cycle that verifies an N-node draft tree (at the drafter's block, the largest of
    `blocks`). Prompts of `prompt_len` random tokens set the context the attention reads. Fused-loop
    times: every shape once per round, `repeats` rounds, the median per shape (`ratio_rounds`: each
    round's cycle over the same round's step)."""
    import jax
    from .attention import default_impl
    from .drafter import init_drafter
    from .generate import generate, rows_layout
    from .model import init_target

    cfg = bench_target_config(config_name, layers, vocab_size, dtype)
    S_chain = cache_len_for([prompt_len], steps + 1, max(blocks))  # each shape's call sizes its own cache
    log(f"config: {config_name} layers={cfg.num_layers} hidden={cfg.hidden_size} vocab={cfg.vocab_size} "
        f"dtype={dtype}; drafter {drafter_layers} layers; batch {batch}; {prompt_len}-token prompts; "
        f"{steps} cycles per run; layers {layout}; attention {default_impl(None, S_chain)} (decode-size calls at "
        f"the longest chain's {S_chain}-slot cache; a tree's may differ); backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind})")
    t0 = time.perf_counter()
    target = init_target(cfg, seed=0, layout=layout, rng="device")  # host draws of 8e9 weights take minutes
    drafter = init_drafter(target, num_layers=drafter_layers, block_size=max(blocks), mask_token_id=cfg.vocab_size - 1,
                           seed=1, target_layer_ids=_drafter_taps(cfg.num_layers, drafter_layers), layout=layout,
                           rng="device")
    jax.block_until_ready((target.params, drafter.params))
    log(f"init: {time.perf_counter() - t0:.1f}s, target {tree_bytes(target.params) / 1e9:.3f} GB, "
        f"drafter {tree_bytes(drafter.params) / 1e9:.3f} GB")
    # the fused loop of every shape, round-robin: each shape compiles (and runs) once, then `repeats` rounds
    # time every shape once each, so a drift of the machine's speed hits all shapes alike; per shape the median
    shapes = [("target", None, None)] + [(f"B={b}", b, None) for b in blocks] + [(f"tree {n}", None, int(n)) for n in trees]
    prompts = _random_prompts(batch, prompt_len, cfg.vocab_size)

    def fused(block, tree):
        kw = dict(max_new_tokens=steps + 1, stop_token_ids=[], block_size=block, tree_budget=tree)
        r = generate(target, drafter if (block or tree) else None, prompts, **kw)
        return r.decode_time / max(r.cycles, 1), r

    for lab, b, n in shapes:
        t0 = time.perf_counter()
        fused(b, n)
        log(f"  {lab}: first call (compiles) {time.perf_counter() - t0:.1f}s")
    times = {lab: [] for lab, _, _ in shapes}
    last = {}
    for _ in range(max(repeats, 1)):
        for lab, b, n in shapes:
            sec, last[lab] = fused(b, n)
            times[lab].append(sec)
    med = {lab: float(np.median(v)) for lab, v in times.items()}
    t_step = med["target"]
    log(f"target-only step: {1e3 * t_step:.2f} ms (median of {len(times['target'])} rounds, "
        f"{1e3 * min(times['target']):.2f}-{1e3 * max(times['target']):.2f})")
    rows = []
    for Bk in blocks:
        t_cyc, r = med[f"B={Bk}"], last[f"B={Bk}"]
        # the same cycle as separately jitted stages, on the same prompts
        st, rows_ids, key, stop, max_new = _prefilled(target, drafter, prompts, prompt_len, steps, Bk, Bk)
        draft, verify, accept = _cycle_parts(target, drafter, Bk)
        # the parts on the weights the fused loop multiplies by (on CPU its row layout, generate.rows_layout)
        lt, ld = rows_layout(target, drafter, Bk)
        box = {"tc": st.tcache, "dc": st.dcache, "out": st.out}
        block = draft(lt, ld, st.anchor, st.dcache)
        post, feats, box["tc"] = verify(lt, box["tc"], block, rows_ids, key)

        def run_draft():
            return draft(lt, ld, st.anchor, box["dc"])

        def run_verify():
            p, f, box["tc"] = verify(lt, box["tc"], block, rows_ids, key)
            return p, f

        def run_accept():
            a, box["out"], box["dc"] = accept(ld, box["dc"], box["out"], block, post, feats, st.gen_len,
                                              st.done, stop, max_new)
            return a

        reps = max(repeats * 3, 5)
        t_d, t_v, t_a = _best_time(run_draft, reps), _best_time(run_verify, reps), _best_time(run_accept, reps)
        parts = t_d + t_v + t_a
        row = {"block": Bk, "cycle_ms": 1e3 * t_cyc, "ratio": t_cyc / t_step, "draft_ms": 1e3 * t_d,
               "verify_ms": 1e3 * t_v, "accept_ms": 1e3 * t_a, "parts_ms": 1e3 * parts,
               "loop_overhead_ms": 1e3 * (t_cyc - parts), "cycles": r.cycles, "tau": r.tau}
        rows.append(row)
        log(f"  B={Bk}: cycle {row['cycle_ms']:.2f} ms = {row['ratio']:.3f} x target step; parts: draft "
            f"{row['draft_ms']:.2f} + verify {row['verify_ms']:.2f} + accept {row['accept_ms']:.2f} = "
            f"{row['parts_ms']:.2f} ms")
        del st, box
    Bk = max(blocks)
    for n in trees:
        lab = f"tree {int(n)}"
        row = {"block": Bk, "tree": int(n), "cycle_ms": 1e3 * med[lab], "ratio": med[lab] / t_step,
               "cycles": last[lab].cycles, "tau": last[lab].tau}
        row.update(_time_tree_parts(target, drafter, prompts, prompt_len, steps, Bk, int(n), repeats))
        rows.append(row)
        log(f"  tree {n}: cycle {row['cycle_ms']:.2f} ms = {row['ratio']:.3f} x target step; parts: draft "
            f"{row['draft_ms']:.2f} + build {row['build_ms']:.2f} + verify {row['verify_ms']:.2f} + accept "
            f"{row['accept_ms']:.2f} = {row['parts_ms']:.2f} ms; the build with a two-stage top-k ({TOPK_CHUNK}-token "
            f"slices) {row['build_two_stage_ms']:.2f} ms")
    for row in rows:  # each shape's cycle / step in every round (the step of the same round)
        lab = f"tree {row['tree']}" if row.get("tree") else f"B={row['block']}"
        per = [c / t for c, t in zip(times[lab], times["target"])]
        row["ratio_rounds"] = per
    return {"config": dataclasses.asdict(cfg), "target_step_ms": 1e3 * t_step, "batch": batch,
            "prompt_len": prompt_len, "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "weight_bytes": tree_bytes(target.params), "rows": rows}


def _time_tree_parts(target, drafter, prompts, prompt_len: int, steps: int, Bk: int, N: int, repeats: int) -> dict:
    """Median ms of each of `_tree_parts`' stages after a prefill of `prompts` (the fused loop's weights)."""
    from .generate import rows_layout, verify_width
    st, rows_ids, key, _, _ = _prefilled(target, drafter, prompts, prompt_len, steps, Bk, verify_width(Bk, N))
    draft, build, build2, verify, accept = _tree_parts(target, drafter, Bk, N)
    lt, ld = rows_layout(target, drafter, verify_width(Bk, N))
    dl = draft(lt, ld, st.anchor, st.dcache)
    tree = build(dl, st.anchor)
    box = {"tc": st.tcache}
    choice, _, box["tc"] = verify(lt, box["tc"], tree, rows_ids, key)

    def run_verify():
        c, f, box["tc"] = verify(lt, box["tc"], tree, rows_ids, key)
        return c, f

    def run_accept():
        a, box["tc"] = accept(box["tc"], tree, choice)
        return a

    reps = max(repeats * 3, 5)
    t = {"draft_ms": _best_time(lambda: draft(lt, ld, st.anchor, st.dcache), reps),
         "build_ms": _best_time(lambda: build(dl, st.anchor), reps),
         "verify_ms": _best_time(run_verify, reps), "accept_ms": _best_time(run_accept, reps)}
    t = {k: 1e3 * v for k, v in t.items()}
    t["parts_ms"] = sum(t.values())
    t["build_two_stage_ms"] = 1e3 * _best_time(lambda: build2(dl, st.anchor), reps)  # not in the sum
    return t


def print_cycle_table(res: dict) -> None:
    log("")
    log(f"target-only step (batch {res['batch']}): {res['target_step_ms']:.2f} ms")
    log(f"{'B':>3} {'T_cycle ms':>10} {'/T_step':>8} {'draft ms':>9} {'verify ms':>10} {'accept ms':>10} "
        f"{'sum parts':>10} {'fused-sum':>10} {'tau':>5}")
    for r in res["rows"]:
        if r.get("tree"):
            continue
        log(f"{r['block']:>3} {r['cycle_ms']:>10.2f} {r['ratio']:>8.3f} {r['draft_ms']:>9.2f} {r['verify_ms']:>10.2f} "
            f"{r['accept_ms']:>10.2f} {r['parts_ms']:>10.2f} {r['loop_overhead_ms']:>10.2f} {r['tau']:>5.2f}")
    log("(fused-sum = fused-loop time per cycle minus the sum of the separately jitted parts; negative = the "
        "fused loop is cheaper than dispatching the parts one by one)")
    trees = [r for r in res["rows"] if r.get("tree")]
    if trees:
        log("")
        log(f"{'tree':>5} {'block':>5} {'rows':>5} {'T_cycle ms':>10} {'/T_step':>8} {'rounds':>13} {'draft ms':>9} "
            f"{'build ms':>9} {'verify ms':>10} {'accept ms':>10} {'sum parts':>10}")
        for r in trees:
            per = r.get("ratio_rounds") or [r["ratio"]]
            log(f"{r['tree']:>5} {r['block']:>5} {r['tree'] + 1:>5} {r['cycle_ms']:>10.2f} {r['ratio']:>8.3f} "
                f"{min(per):>6.3f}-{max(per):<6.3f} {r['draft_ms']:>9.2f} {r['build_ms']:>9.2f} {r['verify_ms']:>10.2f} "
                f"{r['accept_ms']:>10.2f} {r['parts_ms']:>10.2f}")
        log("(tree N: the fused-loop cycle verifying the root and N draft nodes under the tree mask; rounds: the range of "
            "cycle / step over the timed rounds, each over its own round's step; parts: the drafter's block pass + "
            "logits, the tree builder alone, the N + 1 rows' verification, the walk + K/V compaction, jitted apart)")


def main_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
