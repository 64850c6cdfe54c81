"""Prompt benchmarks: one prompt in both modes (`compare_prompt`, python -m infer.generate) and a prompt set
side by side with target-only (`run_benchmark`, python -m infer.benchmark; multi-turn aware) with tau, speedup, the
acceptance-length histogram, fixed shapes beside the automatic one (`auto_against_fixed`), and the report files
(`write_report`: report.json + PNG histogram).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from typing import Sequence

import numpy as np

from .. import text as textlib
from ..prompts import PromptSample
from .args import cache_len_for, log, shape_args, shape_label, verify_width


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
            lab = shape_label(r.block_size, r.tree_budget)
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


def generate_mode(target, drafter, prompts, gk: dict, S: int, block_size, row_ids, tree_budget=None):
    """One generate() call of a benchmark mode: speculative at (block_size, tree_budget) with a drafter,
    target-only without; the cache size S shared by the modes."""
    from ..decode.api import generate
    spec = drafter is not None
    return generate(target, drafter, prompts, block_size=block_size if spec else None, max_cache_len=S,
                    row_ids=row_ids, tree_budget=tree_budget if spec else None, **gk)


# ----------------------------------------------------------------------------------------------
# One prompt (infer.generate)
# ----------------------------------------------------------------------------------------------
WARMUP_LOOKS = 6  # compare_prompt with auto: at most this many more untimed warm-up calls (while auto explores)


def compare_prompt(target, drafter, prompt_ids: list[int], *, gen_kwargs: dict, block_size: int | None = None,
                   compare: bool = True, warmup: bool = True, repeats: int = 1, tree_budget: int | None = None) -> dict:
    """Run one prompt speculatively (when a drafter is given) and/or target-only.

    Returns {"spec": GenerationResult | None, "target": GenerationResult | None, "speedup": float | None,
    "speedups": [float, ...]}. Each mode is run once untimed first when `warmup` (compile and first-run
    costs excluded; with auto, until its call is no longer a look nor compiled); then `repeats` timed
    rounds, the two modes alternating within each round, so load drifts hit both alike. "speedup" is the
    median over the rounds; the results are the first round's (outputs are deterministic for a seed, only
    timings differ)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    block_size, tree_budget, Bk = shape_args(drafter, block_size, tree_budget)
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
            r = generate_mode(target, d, [prompt_ids], gen_kwargs, S, block_size, None, tree_budget)
            # auto: the untimed warm-up goes on while auto explores (auto_look: its first call, a look at
            # another shape) or its call compiled (up to WARMUP_LOOKS calls): a new shape compiles a program for
            # this call, and a program's first run carries one-time costs (~0.2 s on CPU) that are no more part
            # of the steady speed than its compile time
            for _ in range(WARMUP_LOOKS if block_size == "auto" and d is not None else 0):
                if not r.auto_look and r.compile_time == 0:
                    break
                r = generate_mode(target, d, [prompt_ids], gen_kwargs, S, block_size, None, tree_budget)
    for _ in range(repeats):
        res = {name: generate_mode(target, d, [prompt_ids], gen_kwargs, S, block_size, None, tree_budget)
               for name, d in modes}
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
                  tree_budget: int | None = None, fixed_shapes: Sequence = ()) -> dict:
    """Target-only and speculative decoding on the same prompts, batch by batch (the modes alternate per
    batch, so slow drifts of machine load hit them alike).

    Multi-turn samples: turn k's prompt holds the earlier turns' answers; the target-only answer is
    used as history for every mode (identical at temperature 0 by losslessness), so all modes see
    exactly the same prompts. Every turn counts in the statistics. `fixed_shapes` (values Shape.parse
    reads: 8, "chain:8", "tree:16"): also run each of these beside the main shape, reported under "fixed"."""
    from ..decode.shape import Chain, Shape, Tree
    if drafter is None:
        raise ValueError("the benchmark needs a drafter (--drafter)")
    if not samples:
        raise ValueError("no prompts to benchmark")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    block_size, tree_budget, Bk = shape_args(drafter, block_size, tree_budget)
    extra = []  # (label, block, tree) of each fixed shape
    for v in fixed_shapes:
        s = Shape.parse(v).resolve(drafter.config.block_size, target.config.vocab_size)
        if not isinstance(s, (Chain, Tree)):
            raise ValueError(f"fixed shape {v!r}: expected a chain (B or chain:B) or a tree (tree:N)")
        extra.append((shape_label(s.block, s.tree), s.block, s.tree))
    max_new = int(gen_kwargs["max_new_tokens"])

    def encode(msgs):
        return textlib.encode_chat(tok, msgs, use_chat_template=use_chat_template, enable_thinking=enable_thinking)

    st_t, st_s = ModeStats(), ModeStats()
    st_x = {lab: ModeStats() for lab, _, _ in extra}
    same_x = {lab: 0 for lab, _, _ in extra}
    per_sample = [{"id": s.id, "turns": []} for s in samples]
    same = total = 0
    parts: list[int] = []  # per differing output: the index of its first token that differs
    batches = [list(range(i, min(i + batch_size, len(samples)))) for i in range(0, len(samples), batch_size)]
    first_prompts = [encode(s.chat(0, [])) for s in samples]
    # One cache size for the whole run (grown only if a later turn needs more): the decode loop then
    # compiles once per batch shape instead of once per prompt length.
    W = max([verify_width(block_size or Bk, tree_budget)] + [verify_width(b, n) for _, b, n in extra])
    S_run = cache_len_for([len(p) for p in first_prompts], max_new, W, target.config.max_position_embeddings)
    t_start = time.perf_counter()
    if warmup:
        first = batches[0]
        prompts = [first_prompts[i] for i in first]
        if verbose:
            log(f"warm-up on batch 0 ({len(first)} prompt(s)), "
                + (f"{2 + len(extra)} modes ..." if extra else "both modes ..."))
        generate_mode(target, None, prompts, gen_kwargs, S_run, block_size, first)
        generate_mode(target, drafter, prompts, gen_kwargs, S_run, block_size, first, tree_budget)
        for _, b, n in extra:
            generate_mode(target, drafter, prompts, gen_kwargs, S_run, b, first, n)
    for bi, idx in enumerate(batches):
        answers: dict[int, list[str]] = {i: [] for i in idx}
        max_turns = max(samples[i].num_turns for i in idx)
        for turn in range(max_turns):
            rows = [i for i in idx if samples[i].num_turns > turn]
            prompts = [first_prompts[i] if turn == 0 else encode(samples[i].chat(turn, answers[i])) for i in rows]
            S_run = S = max(S_run, cache_len_for([len(p) for p in prompts], max_new, W,
                                                 target.config.max_position_embeddings))
            stop = gen_kwargs.get("stop_token_ids")
            rt = generate_mode(target, None, prompts, gen_kwargs, S, block_size, rows)
            rs = generate_mode(target, drafter, prompts, gen_kwargs, S, block_size, rows, tree_budget)
            st_t.add(rt)
            st_s.add(rs)
            for lab, b, n in extra:
                rx = generate_mode(target, drafter, prompts, gen_kwargs, S, b, rows, n)
                st_x[lab].add(rx)
                same_x[lab] += sum(int(x == y) for x, y in zip(rt.tokens, rx.tokens))
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
        "fixed": [{"shape": lab, "block": b, "tree": n, "tau": st_x[lab].tau,
                   "speedup": st_t.time_per_output_token / st_x[lab].time_per_output_token,
                   "identical_outputs": same_x[lab], "speculative": st_x[lab].to_json()} for lab, b, n in extra],
        "samples": per_sample,
    }


def auto_against_fixed(rep: dict) -> str | None:
    """One line: the automatic shape's choices (or the run's shape), tau and speedup beside the best fixed shape of
    the same run (run_benchmark's "fixed"), so a reader sees whether auto chose well. None without fixed shapes."""
    if not rep.get("fixed"):
        return None
    if rep.get("block_size") == "auto":
        chose = rep["speculative"].get("auto_choices") or {}
        main = "auto (" + (", ".join(f"{k} x{v}" for k, v in sorted(chose.items(), key=lambda kv: -kv[1])) or "?") + ")"
    else:
        main = shape_label(rep.get("block_size"), rep.get("tree_budget"))
    best = max(rep["fixed"], key=lambda f: f["speedup"])
    others = [f for f in rep["fixed"] if f is not best]
    line = (f"{main}: tau {rep['tau']:.2f} speedup {rep['speedup']:.3f}x; best fixed: {best['shape']} "
            f"tau {best['tau']:.2f} speedup {best['speedup']:.3f}x")
    if others:
        line += " (" + ", ".join(f"{f['shape']}: tau {f['tau']:.2f} speedup {f['speedup']:.3f}x" for f in others) + ")"
    return line + f"; {main.split(' (')[0]} / best fixed {rep['speedup'] / best['speedup']:.2f}"


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
