"""Sweep benchmark of a target/drafter pair: data sets x temperatures x block sizes, side by side.

For every (data set, temperature) the prompts are processed batch by batch; each batch is decoded
target-only and then speculatively at every block size, with one KV-cache size for all modes, so
all block sizes and the target-only baseline are measured in the same run under the same machine
load. Outputs: sweep.json (all figures), sweep.md (combined table), PNG plots (tau and speedup per
block size, acceptance-length histograms).

Speedup = target-only decode time per output token / speculative decode time per output token
(prefill and compilation excluded; every mode is warmed up on the first batch before timing).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from typing import Sequence

import numpy as np

from . import text as textlib
from .bench.args import cache_len_for, log, verify_width
from .bench.datasets import ModeStats, generate_mode

DEFAULT_SETS = (("gsm8k", 50), ("math500", 10), ("humaneval", 10), ("mt-bench", 10))


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import jax
        info["jax"] = jax.__version__
        info["devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def shape_label(key: str) -> str:
    """'8' -> 'B=8' (chain of drafts), 'tree16' -> 'tree 16' (16-node tree at the drafter's block),
    'auto' -> 'auto' (block_size / tree_budget chosen per call, dflash_jax.auto)."""
    key = str(key)
    return key if key == "auto" else f"tree {key[4:]}" if key.startswith("tree") else f"B={key}"


def _widest(blocks, trees, drafter_block: int, auto: bool) -> int:
    """Cache slots the widest verification of a sweep writes (chains, trees, and auto's widest choice)."""
    return max([verify_width(b, None) for b in blocks] + [verify_width(drafter_block, n) for n in trees]
               + ([verify_width("auto", "auto")] if auto else []))


def sweep_one(target, drafter, tok, samples, *, temperature: float, blocks: Sequence[int], max_new_tokens: int,
              batch_size: int = 1, seed: int = 0, cache_len: int | None = None, repeats: int = 1,
              verbose: bool = True, trees: Sequence[int] = (), auto: bool = False) -> dict:
    """One data set at one temperature: target-only + every block size + every tree budget (trees use
    the drafter's own block) + with `auto` the automatic shape, batch by batch (first turns only). Results
    are keyed '4' (chain B=4), 'tree16' (a 16-node tree) and 'auto' (its choices counted per shape).

    With `repeats` > 1 the whole timed pass runs that many times; speedups, tokens/s and cycle costs are
    reported as the median over the passes with their range (outputs and tau are the same every pass)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    stop = textlib.stop_token_ids(tok, target.config)
    gk = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=0, top_p=1.0, stop_token_ids=stop,
              seed=seed)
    prompts = [textlib.encode_chat(tok, s.chat(0, [])) for s in samples]
    Bd = drafter.config.block_size
    width = _widest(blocks, trees, Bd, auto)
    S = max(cache_len or 0, cache_len_for([len(p) for p in prompts], max_new_tokens, width))
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    modes = ([("target", None, None, None)] + [(str(b), drafter, b, None) for b in blocks]
             + [(f"tree{n}", drafter, Bd, n) for n in trees] + ([("auto", drafter, "auto", "auto")] if auto else []))
    first = batches[0]
    for _, d, b, n in modes:  # warm-up (compile) on the first batch
        generate_mode(target, d, [prompts[i] for i in first], gk, S, b, first, n)
    passes = []
    same = {m: 0 for m, _, _, _ in modes[1:]}
    examples = []
    for rep_i in range(repeats):
        stats = {m: ModeStats() for m, _, _, _ in modes}
        t0 = time.perf_counter()
        for bi, idx in enumerate(batches):
            ps = [prompts[i] for i in idx]
            outs = {}
            for m, d, b, n in modes:
                r = generate_mode(target, d, ps, gk, S, b, idx, n)
                stats[m].add(r)
                outs[m] = r
            if rep_i == 0:
                for m in same:
                    same[m] += sum(int(a == c) for a, c in zip(outs["target"].tokens, outs[m].tokens))
                if bi < 2:
                    best = str(max(blocks)) if blocks else modes[-1][0]
                    examples.append({"prompt": samples[idx[0]].turns[0],
                                     "output": textlib.decode(tok, outs[best].tokens[0], stop),
                                     "acceptance_lengths": [int(x) for x in outs[best].acceptance_lengths[0]]})
            if verbose and (bi + 1) % max(1, len(batches) // 4) == 0:
                msg = ", ".join(f"{shape_label(m)}: tau {stats[m].tau:.2f} "
                                f"x{stats['target'].time_per_output_token / stats[m].time_per_output_token:.2f}"
                                for m in same)
                log(f"  pass {rep_i + 1}/{repeats} batch {bi + 1}/{len(batches)} ({time.perf_counter() - t0:.0f}s): "
                    f"{msg}")
        passes.append(stats)

    def spread(values) -> dict:
        v = [float(x) for x in values]
        return {"median": float(np.median(v)), "min": min(v), "max": max(v), "runs": v}

    stats = passes[0]
    base = stats["target"]
    step_ms = [1e3 * p["target"].decode_time / max(p["target"].loop_cycles, 1) for p in passes]
    res = {"temperature": temperature, "num_prompts": len(prompts), "batch_size": batch_size,
           "max_new_tokens": max_new_tokens, "cache_len": S, "repeats": repeats, "target_only": base.to_json(),
           "target_tokens_per_second": spread(p["target"].tokens_per_second for p in passes),
           "target_ms_per_step": float(np.median(step_ms)), "blocks": {}, "examples": examples}
    for m, _, b, _ in modes[1:]:
        s = stats[m]
        speedups = [p["target"].time_per_output_token / p[m].time_per_output_token for p in passes]
        cyc_ms = [1e3 * p[m].decode_time / max(p[m].loop_cycles, 1) for p in passes]
        res["blocks"][m] = {
            "tau": s.tau, "speedup": float(np.median(speedups)), "speedup_spread": spread(speedups),
            "histogram": s.histogram(Bd if b == "auto" else b), "identical_outputs": same[m], "ms_per_cycle": float(np.median(cyc_ms)),
            "cycle_cost_in_target_steps": float(np.median([c / t for c, t in zip(cyc_ms, step_ms)])),
            **{f"spec_{k}": v for k, v in s.to_json().items()}}
    return res


def run_sweep(target_path: str, drafter_path: str, out_dir: str, sets=DEFAULT_SETS, temperatures=(0.0, 1.0),
              blocks=(4, 8, 16), max_new_tokens: int = 256, batch_size: int = 1, data_dir: str | None = None,
              seed: int = 0, dtype: str = "float32", plot: bool = True, repeats: int = 1,
              trees: Sequence[int] = (), auto: bool = False) -> dict:
    from .bench import load_models
    from .prompts import load_dataset_prompts
    tok = textlib.load_tokenizer(target_path)
    target, drafter = load_models(target_path, drafter_path, dtype)
    rep = {"target": target_path, "drafter": drafter_path, "dtype": dtype, "machine": machine_info(),
           "blocks": [str(b) for b in blocks] + [f"tree{n}" for n in trees] + (["auto"] if auto else []),
           "repeats": repeats, "runs": []}
    t_all = time.perf_counter()
    loaded = [(name, load_dataset_prompts(name, data_dir, n)) for name, n in sets]
    # one KV-cache size for every set: the decode loop compiles once per (mode, temperature)
    longest = max(len(textlib.encode_chat(tok, s.chat(0, []))) for _, ss in loaded for s in ss)
    width = _widest(blocks, trees, drafter.config.block_size, auto)
    S = cache_len_for([longest], max_new_tokens, width)
    rep["cache_len"] = S
    for name, samples in loaded:
        for T in temperatures:
            log(f"[{name} T={T}] {len(samples)} prompts, blocks {list(blocks)}, trees {list(trees)}, "
                f"max_new_tokens {max_new_tokens}")
            t0 = time.perf_counter()
            r = sweep_one(target, drafter, tok, samples, temperature=T, blocks=blocks, max_new_tokens=max_new_tokens,
                          batch_size=batch_size, seed=seed, cache_len=S, repeats=repeats, trees=trees, auto=auto)
            r.update(dataset=name, wall_s=round(time.perf_counter() - t0, 1))
            rep["runs"].append(r)
            log("  " + "; ".join(f"{shape_label(b)}: tau {v['tau']:.2f}, speedup {v['speedup']:.2f}x"
                                 for b, v in r["blocks"].items()))
    rep["wall_s"] = round(time.perf_counter() - t_all, 1)
    try:
        rep["machine"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    write_sweep(rep, out_dir, plot)
    return rep


def markdown_table(rep: dict) -> str:
    blocks = rep["blocks"]
    head = "| data set | T | prompts | target-only tok/s | " + " | ".join(
        f"{shape_label(b)} tau | {shape_label(b)} speedup" for b in blocks) + " | identical (T=0) |"
    sep = "|" + "---|" * (4 + 2 * len(blocks) + 1)
    lines = [head, sep]
    for r in rep["runs"]:
        cells = [r["dataset"], f"{r['temperature']:g}", str(r["num_prompts"]),
                 f"{r['target_only']['tokens_per_second']:.1f}"]
        for b in blocks:
            v = r["blocks"][str(b)]
            sp = v.get("speedup_spread")
            rng = f" ({sp['min']:.2f}-{sp['max']:.2f})" if sp and len(sp["runs"]) > 1 else ""
            cells += [f"{v['tau']:.2f}", f"{v['speedup']:.2f}x{rng}"]
        ident = "/".join(str(r["blocks"][str(b)]["identical_outputs"]) for b in blocks) \
            if r["temperature"] == 0 else "-"
        cells.append(ident + (f" of {r['num_prompts']}" if r["temperature"] == 0 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overhead_table(rep: dict) -> str:
    blocks = rep["blocks"]
    lines = ["| data set | T | target ms/step | " + " | ".join(f"{shape_label(b)} ms/cycle (x step)" for b in blocks)
             + " |",
             "|" + "---|" * (3 + len(blocks))]
    for r in rep["runs"]:
        cells = [r["dataset"], f"{r['temperature']:g}", f"{r['target_ms_per_step']:.2f}"]
        for b in blocks:
            v = r["blocks"][str(b)]
            cells.append(f"{v['ms_per_cycle']:.2f} ({v['cycle_cost_in_target_steps']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_sweep(rep: dict, out_dir: str, plot: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "sweep.json"), "markdown": os.path.join(out_dir, "sweep.md")}
    with open(paths["json"], "w") as f:
        json.dump(rep, f, indent=2, default=float)
    m = rep["machine"]
    md = ["# Reference pair benchmark sweep", "",
          f"Machine: {m.get('cpu_model', '?')}, {m.get('cpus')} CPU cores visible, {m.get('platform')}, "
          f"jax {m.get('jax', '?')}; load average at start {m.get('loadavg_start')}, end {m.get('loadavg_end')}.",
          f"Target {rep['target']}, drafter {rep['drafter']}, dtype {rep['dtype']}. Total wall {rep['wall_s']} s.",
          "", "## tau and speedup (decode time per output token, prefill excluded)", "",
          (f"Speedups are the median of {rep.get('repeats', 1)} timed passes over the same prompts, (range) "
           f"beside them; tau and outputs are identical in every pass." if rep.get("repeats", 1) > 1 else
           "One timed pass (run with --repeats 3 for medians and ranges)."), "", markdown_table(rep), "",
          "## Per-cycle cost", "", overhead_table(rep), ""]
    if plot:
        paths.update(plot_sweep(rep, out_dir))
        md += ["## Plots", ""] + [f"![{k}]({os.path.basename(v)})" for k, v in paths.items()
                                  if v.endswith(".png")] + [""]
    with open(paths["markdown"], "w") as f:
        f.write("\n".join(md))
    return paths


def plot_sweep(rep: dict, out_dir: str) -> dict:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    out = {}
    blocks = [str(b) for b in rep["blocks"]]
    xs = list(range(len(blocks)))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in rep["runs"]:
        lab = f"{r['dataset']} T={r['temperature']:g}"
        axes[0].plot(xs, [r["blocks"][b]["tau"] for b in blocks], marker="o", label=lab)
        axes[1].plot(xs, [r["blocks"][b]["speedup"] for b in blocks], marker="o", label=lab)
    axes[0].set_ylabel("tau (mean acceptance length)")
    axes[1].set_ylabel("speedup over target-only")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    for ax in axes:
        ax.set_xlabel("shape (chain block / tree nodes)")
        ax.set_xticks(xs, [shape_label(b) for b in blocks], rotation=45, fontsize=7)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    p = os.path.join(out_dir, "tau_speedup.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    out["tau_speedup"] = p
    chain = [int(b) for b in blocks if b.isdigit()]
    if not chain:
        return out
    b = max(chain)
    runs = rep["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], runs):
        h = np.asarray(r["blocks"][str(b)]["histogram"], float)
        ax.bar(np.arange(1, b + 1), h / max(h.sum(), 1), color="#3b75af")
        ax.set_title(f"{r['dataset']} T={r['temperature']:g}\ntau {r['blocks'][str(b)]['tau']:.2f}", fontsize=8)
        ax.set_xlabel("acceptance length")
    axes[0][0].set_ylabel(f"fraction of cycles (B={b})")
    fig.tight_layout()
    p = os.path.join(out_dir, f"histograms_B{b}.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    out[f"histograms_B{b}"] = p
    return out


def cycle_breakdown(target_path: str, drafter_path: str, blocks=(4, 8, 16), cycles: int = 64, prompt_len: int = 96,
                    dtype: str = "float32") -> dict:
    """Batch-1 cost of one target-only step, one fused speculative cycle per block size, and that cycle's
    drafter pass and verification pass jitted separately (no stop tokens, random prompt)."""
    import jax
    import jax.numpy as jnp

    from .bench.bandwidth import best_time, time_decode
    from .bench.cycle_parts import chain_parts
    from .bench.models import load_models
    from .decode.programs import prefill
    from .sampling import SamplingParams
    target, drafter = load_models(target_path, drafter_path, dtype)
    out = {"target_step_ms": 1e3 * time_decode(target, None, 1, cycles, prompt_len=prompt_len, repeats=3)["step_s"],
           "cycles": cycles, "prompt_len": prompt_len, "blocks": {}}
    rng = np.random.default_rng(0)
    for Bk in blocks:
        fused = time_decode(target, drafter, 1, cycles, prompt_len=prompt_len, block_size=Bk, repeats=3)["step_s"]
        S = cache_len_for([prompt_len], cycles + 1, Bk)
        toks = jnp.asarray(rng.integers(10, target.config.vocab_size - 64, (1, prompt_len)).astype(np.int32))
        lens, rows = jnp.full((1,), prompt_len, jnp.int32), jnp.zeros((1,), jnp.int32)
        key, stop = jax.random.PRNGKey(0), jnp.full((1, 1), -1, jnp.int32)
        pre = jax.jit(lambda t, d, a, b, c, k, s, Bk=Bk, S=S: prefill(t, d, a, b, c, k, s, jnp.full((1,), cycles + 1),
                                                                      S=S, Bk=Bk, sp=SamplingParams()))
        st = pre(target, drafter, toks, lens, rows, key, stop)
        draft, verify, _ = chain_parts(Bk)
        box = {"tc": st.tcache}
        block = draft(target, drafter, st.anchor, st.dcache)

        def run_verify():
            p, _, box["tc"] = verify(target, drafter, box["tc"], block, rows, key)
            return p
        t_d = best_time(lambda: draft(target, drafter, st.anchor, st.dcache), 20)
        t_v = best_time(run_verify, 20)
        step = out["target_step_ms"]
        out["blocks"][str(Bk)] = {"fused_cycle_ms": 1e3 * fused, "draft_ms": 1e3 * t_d, "verify_ms": 1e3 * t_v,
                                  "fused_cycle_in_steps": 1e3 * fused / step, "draft_in_steps": 1e3 * t_d / step,
                                  "verify_in_steps": 1e3 * t_v / step}
        log(f"B={Bk}: cycle {1e3 * fused:.2f} ms = {1e3 * fused / step:.1f} target steps "
            f"(draft {1e3 * t_d:.2f} ms, verify {1e3 * t_v:.2f} ms); target step {step:.3f} ms")
    return out
