"""The concurrency curve: what one decode step and one speculative cycle cost per batch size, from the TPU
compiler (dflash_jax.planner), without a TPU.

For each cache length and each number of rows per chip, the target-only step's roofline time and every shape's
cycle / step ratio, which is also the break-even tau: a shape beats target-only decoding when its cycles commit
more tokens than that on average. As the batch grows, the verify of B tokens per row turns from bandwidth-bound
(a cycle costs about one step) to compute-bound (a cycle costs up to B steps), so the best shape shrinks, down to
target-only; a server choosing its shape per batch size (load-aware speculation) reads it from here.

    python -m infer.plan_curve --target configs/models/qwen3-8b --tpu v5p-8 --out reports/tpu_plan/concurrency
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from . import planner as pl

ROWS_PER_CHIP = (1, 4, 16, 32, 64, 128)
CACHES = (4096, 32768)
BLOCKS = (4, 8, 16)
TREES = (16, 64)
ROOM = 128  # slots a cycle may write past the planned fill (a tree of up to 127 nodes)


def shape_key(block: int | None = None, tree: int | None = None) -> str:
    return f"tree {tree}" if tree else f"B={block}"


def curve(target: str, tpu: str = "v5p-8", *, rows_per_chip: Sequence[int] = ROWS_PER_CHIP,
          caches: Sequence[int] = CACHES, blocks: Sequence[int] = BLOCKS, trees: Sequence[int] = TREES,
          drafter: str | None = None, drafter_layers: int = 5, block_size: int = 16, dtype: str = "bfloat16",
          largest: bool = True, cost_method: str = "full", log=None, previous: dict | None = None,
          on_point=None) -> dict:
    """{"points": [{cache, rows_per_chip, batch, fits (the target step), step_ms, min_step_ms,
    ratios: {shape: cycle / step}, no_fit: [shapes compiled that do not fit]}],
    "largest": {cache: the largest rows per chip whose biggest-block cycle fits}, ...}. The prompt fills 7/8
    of the cache and the answer the rest but ROOM slots, so every program reads a nearly full cache.

    previous: an earlier (interrupted) result of the same settings: its points and largest batches are kept, not
    compiled again. on_point(result so far): called after each point (the CLI writes the partial result)."""
    log = log or (lambda *_: None)
    on_point = on_point or (lambda *_: None)
    if not caches or not rows_per_chip or any(int(r) < 1 for r in rows_per_chip):
        raise pl.PlanError("caches and rows per chip must be non-empty and positive")
    data, _ = pl.parse_mesh(None, pl.resolve_tpu(tpu).chips)
    out = {"target": os.path.abspath(target), "tpu": tpu, "dtype": dtype, "data": data, "blocks": list(blocks),
           "trees": list(trees), "cost_method": cost_method, "points": [], "largest": {}}
    done = {}
    if previous:
        same = {k: out[k] for k in ("target", "tpu", "dtype", "blocks", "trees", "cost_method")}
        other = {k: previous.get(k) for k in same}
        if other != same:
            raise pl.PlanError(f"the earlier result was made with other settings ({other} against {same}): "
                               "remove it or pass the same ones")
        done = {(p["cache"], p["rows_per_chip"]): p for p in previous.get("points", [])}
        out["largest"] = dict(previous.get("largest", {}))
    for S in caches:
        S = int(S)
        prompt, new = S - S // 8, S // 8 - ROOM
        if new < 1:
            raise pl.PlanError(f"cache {S} too short for the curve (at least {8 * (ROOM + 1)} slots)")
        kw = dict(drafter=drafter, drafter_layers=drafter_layers, block_size=block_size, prompt_len=prompt,
                  max_new_tokens=new, cache_len=S, dtype=dtype, prefill=False, log=log)
        grid = sorted({int(r) for r in rows_per_chip})
        if largest and str(S) not in out["largest"]:
            rep = pl.plan(target, tpu, batch=data, block_sizes=(max(blocks),), largest_batch=True, cost=False, **kw)
            lb = rep.get("largest_batch", {}).get("batch")
            if lb:
                out["largest"][str(S)] = lb // data
            on_point(out)
        if largest and str(S) in out["largest"]:
            grid = sorted(set(grid) | {out["largest"][str(S)]})
        for r in grid:
            if (S, r) in done:
                out["points"].append(done[(S, r)])
                continue
            shapes = dict(block_sizes=tuple(blocks), tree_budgets=tuple(trees))
            if largest and str(S) in out["largest"] and r > out["largest"][str(S)]:
                # past the biggest block's last fitting batch: the target step (what a loaded server falls back
                # to) and the smaller blocks; a tree verifies more tokens per row than the biggest block
                shapes = dict(block_sizes=tuple(b for b in blocks if b < max(blocks)) or (max(blocks),),
                              tree_budgets=())
            rep = pl.plan(target, tpu, batch=r * data, largest_batch=False, cost_method=cost_method, **shapes, **kw)
            out["points"].append(point(rep, S, r, data))
            log(format_point(out["points"][-1]))
            on_point(out)
    return out


def point(rep: dict, S: int, rows: int, data: int) -> dict:
    progs = rep["programs"]
    step = next(p for p in progs if p["name"] == "target_step")
    p = {"cache": S, "rows_per_chip": rows, "batch": rows * data, "fits": bool(step["fits"]), "ratios": {},
         "temp_gib": {}, "hbm_over_min": {}, "no_fit": [], "errors": []}
    if not step["fits"] or not step.get("roofline_seconds"):
        return p
    p["step_ms"] = 1e3 * step["roofline_seconds"]
    p["min_step_ms"] = 1e3 * step["min_seconds"]
    for q in progs:
        key = "step" if q["name"] == "target_step" else shape_key(q.get("block_size"), q.get("tree_budget"))
        if q["fits"] and q.get("roofline_seconds"):
            if key != "step":
                p["ratios"][key] = q["roofline_seconds"] / step["roofline_seconds"]
            p["temp_gib"][key] = q["temp_bytes"] / 2 ** 30
            p["hbm_over_min"][key] = q["hbm_bytes"] / q["min_bytes"]
        elif q.get("compile_error"):
            p["errors"].append(key)
        elif not q["fits"]:
            p["no_fit"].append(key)
    return p


def format_point(p: dict) -> str:
    if not p.get("step_ms"):
        return f"cache {p['cache']}, {p['rows_per_chip']} rows per chip: the target step does not fit"
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in p["ratios"].items()) or "none: no cycle fits"
    return (f"cache {p['cache']}, {p['rows_per_chip']} rows per chip: step {p['step_ms']:.3g} ms "
            f"({p['hbm_over_min']['step']:.2f}x min bytes); cycle / step {ratios}")


def markdown(res: dict) -> str:
    keys = [shape_key(b) for b in res["blocks"]] + [shape_key(tree=n) for n in res["trees"]]
    lines = []
    for S in sorted({p["cache"] for p in res["points"]}):
        lines += [f"\nCache {S} ({res['tpu']}, {res['dtype']}; cycle / target step = break-even tau; no fit: the "
                  "program does not fit the chip; -: not compiled, a bigger block's cycle does not fit):\n",
                  "| rows per chip | batch | step ms | step bytes / min | " + " | ".join(keys) + " |",
                  "|---" * (4 + len(keys)) + "|"]
        for p in (q for q in res["points"] if q["cache"] == S):
            if not p.get("step_ms"):
                lines.append(f"| {p['rows_per_chip']} | {p['batch']} | step does not fit |" + " |" * (1 + len(keys)))
                continue
            cells = [f"{p['ratios'][k]:.2f}" if k in p["ratios"] else "no fit" if k in p.get("no_fit", ())
                     else "error" if k in p.get("errors", ()) else "-"
                     for k in keys]
            lines.append(f"| {p['rows_per_chip']} | {p['batch']} | {p['step_ms']:.3g} | "
                         f"{p['hbm_over_min']['step']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    caches = sorted({p["cache"] for p in res["points"]})
    fig, axes = plt.subplots(1, len(caches), figsize=(6 * len(caches), 4.2), squeeze=False)
    keys = [shape_key(b) for b in res["blocks"]] + [shape_key(tree=n) for n in res["trees"]]
    for ax, S in zip(axes[0], caches):
        pts = [p for p in res["points"] if p["cache"] == S and p.get("step_ms")]
        for k in keys:
            xs = [p["rows_per_chip"] for p in pts if k in p["ratios"]]
            ax.plot(xs, [p["ratios"][k] for p in pts if k in p["ratios"]], marker="o", label=k)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per chip")
        ax.set_ylabel("cycle / target step (break-even tau)")
        ax.set_title(f"{os.path.basename(res['target'].rstrip('/'))}, {res['tpu']}, cache {S}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_partial(out_dir: str) -> dict | None:
    """The result an interrupted run left in `out_dir` (see `write_partial`), else None."""
    path = os.path.join(out_dir, PARTIAL)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_partial(res: dict, out_dir: str) -> str:
    """The result so far, replaced atomically after each point (`curve(previous=read_partial(...))` resumes)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PARTIAL)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


PARTIAL = "curve.partial.json"


def write(res: dict, out_dir: str) -> dict:
    """curve.json, curve.md and curve.png in `out_dir`; the partial result of the run is removed."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "curve.json"), "md": os.path.join(out_dir, "curve.md"),
             "png": os.path.join(out_dir, "curve.png")}
    with open(paths["json"], "w") as f:
        json.dump(res, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(markdown(res))
    plot(res, paths["png"])
    if os.path.exists(os.path.join(out_dir, PARTIAL)):
        os.remove(os.path.join(out_dir, PARTIAL))
    return paths
