"""The planner's reports: the human-readable summary, a markdown table of several reports, the JSON file."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

from .topology import GiB


def _gb(x):
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def _gib(x):
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def format_report(rep: dict) -> str:
    lines = [f"{rep['tpu']} ({rep['topology']}, {rep['chips']} chips, {rep['hosts']} host(s)), mesh data="
             f"{rep['mesh']['data']} model={rep['mesh']['model']}, HBM {_gib(rep['hbm_bytes_per_chip'])} per chip"
             + (f", MoE combine {rep['moe_combine']}" if rep.get("moe_combine") else "")
             + (f", weights {rep['quant']}" if rep.get("quant") else "")
             + (f", KV cache {rep['kv_quant']}" if rep.get("kv_quant") else "")]
    if "train" in rep:
        t = rep["train"]
        lines.append(f"training step of {t['config']}: {t['micro_batch']} sequences x {t['seq_len']} tokens x "
                     f"{t['num_anchors']} anchors per micro-batch ({t.get('per_chip', '?')} per chip), grad_accum "
                     f"{t['grad_accum']}")
        if t.get("hbm_needed_bytes") is not None:
            lines.append(f"HBM per chip: {_gib(t['hbm_needed_bytes'])} of {_gib(rep['hbm_bytes_per_chip'])} "
                         f"({100 * t['hbm_spare_fraction']:.1f}% spare)")
        if t.get("sequences_per_second"):
            lines.append(f"roofline: {t['sequences_per_second']:.2f} sequences/s for the slice "
                         f"({t['sequences_per_second'] / rep['chips']:.3f} per chip, {t['bound']}-bound); model flops "
                         f"{t['model_flops_per_sequence'] / 1e12:.1f} T per sequence, the compiled step does "
                         f"{t['compiled_over_model_flops']:.2f}x that (recomputation, dense masks): implied MFU "
                         f"{100 * t['mfu_at_roofline']:.0f}% at the roofline")
    if rep.get("recurrent_state_bytes_per_chip") is not None:
        lines.append(f"recurrent state (Gated DeltaNet layers, all rows): {_gib(rep['recurrent_state_bytes_per_chip'])} "
                     f"per chip, in the arguments below; read and written once per step (counted in min bytes)")
    lines.append("per chip:")
    hdr = f"{'program':<14}{'block':>6}{'batch':>6}{'cache':>7}  {'fits':<5}{'args':>11}{'temp':>11}" \
          f"{'flops':>11}{'bytes acc.':>12}{'HBM bytes':>11}{'min bytes':>11}{'roofline':>11}{'collect.':>11}"
    lines.append(hdr)
    for p in rep["programs"]:
        rl, fl = p.get("roofline_seconds"), p.get("flops")
        block, cache = p.get("block_size") or "-", p.get("cache_len") or "-"
        flops = "-" if fl is None else f"{fl / 1e12:.2f} T"
        roof = "-" if rl is None else f"{rl * 1e3:.2f} ms"
        name = p["name"]
        if p.get("tree_budget"):  # tree16_cycle; the engine's tree call: engine_tree16
            name = f"tree{p['tree_budget']}_cycle" if name == "tree_cycle" else f"engine_tree{p['tree_budget']}"
        fits = "yes" if p["fits"] else "ERROR" if p.get("compile_error") else "NO"
        lines.append(f"{name:<14}{block!s:>6}{p['batch']:>6}{cache!s:>7}  {fits:<5}"
                     f"{_gib(p['argument_bytes']):>11}{_gib(p['temp_bytes']):>11}{flops:>11}"
                     f"{_gb(p['bytes_accessed']):>12}{_gb(p.get('hbm_bytes')):>11}{_gb(p['min_bytes']):>11}{roof:>11}"
                     f"{_gb(p.get('collective_bytes')):>11}")
        if p.get("compile_error"):
            lines.append(f"    compile error (not a capacity limit): {p['error']}")
        elif not p["fits"]:
            lines.append(f"    does not fit: {p['error']}")
        if p.get("cost_note"):
            lines.append(f"    note: {p['cost_note']}")
    for b, x in rep.get("cycle_over_step", {}).items():
        lines.append(f"cycle_over_step (block {b}) = {x:.2f}: break-even tau {x:.2f} (DFlash beats the target-only "
                     f"step when a cycle commits more than {x:.2f} tokens on average)")
    for n, x in rep.get("tree_cycle_over_step", {}).items():
        lines.append(f"tree_cycle_over_step ({n} nodes) = {x:.2f} target steps (roofline)")
    lb = rep.get("largest_batch")
    if lb:
        exact = "" if lb["exact"] else f" (search stopped; {lb['smallest_not_fitting']} does not fit)"
        lines.append(f"largest batch whose block-{lb['block_size']} cycle fits at this cache: {lb['batch']}{exact}"
                     f" [{lb['probes']} extra compile(s)]")
        if lb.get("compile_error"):
            lines.append(f"    the search stopped on a compile error (not a capacity limit): {lb['compile_error']}")
    return "\n".join(lines)


def markdown_table(reports: Sequence[dict]) -> str:
    """One markdown table of several JSON reports (reports/tpu_plan/README.md)."""
    rows = [("| model | TPU (mesh) | program | block | batch | cache | fits | args / chip | temp / chip | "
             "bytes accessed | HBM bytes | min bytes | roofline | cycle / step |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rep in reports:
        model = os.path.basename(os.path.dirname(rep["target"])) if rep["target"].endswith(".json") \
            else os.path.basename(rep["target"])
        model += "".join(f" ({what} {rep[k]})" for k, what in (("quant", "weights"), ("kv_quant", "KV")) if rep.get(k))
        mesh = f"{rep['tpu']} (data={rep['mesh']['data']}, model={rep['mesh']['model']})"
        for p in rep["programs"]:
            rl = p.get("roofline_seconds")
            ratio = rep.get("cycle_over_step", {}).get(str(p.get("block_size"))) if p["name"] == "cycle" else None
            if p.get("tree_budget"):
                ratio = rep.get("tree_cycle_over_step", {}).get(str(p["tree_budget"]))
            fits = ("yes" if p["fits"] else "**compile error**: " + p.get("error", "")[:80] if p.get("compile_error")
                    else "**no**: " + _oom_summary(p.get("error", "")))
            name = p["name"]
            if p.get("tree_budget"):
                name = f"{'tree cycle' if name == 'tree_cycle' else name + ' (tree)'}, {p['tree_budget']} nodes"
            rows.append(f"| {model} | {mesh} | {name} | {p.get('block_size') or '-'} | {p['batch']} | "
                        f"{p.get('cache_len') or '-'} | {fits} | {_gib(p['argument_bytes'])} | {_gib(p['temp_bytes'])} | "
                        f"{_gb(p['bytes_accessed'])}{' (one chunk)' if p.get('cost_note') else ''} | {_gb(p.get('hbm_bytes'))} | {_gb(p['min_bytes'])} | "
                        f"{'-' if rl is None else f'{rl * 1e3:.1f} ms'} | {'-' if ratio is None else f'{ratio:.2f}'} |")
        lb = rep.get("largest_batch")
        if lb:
            rows.append(f"| {model} | {mesh} | largest batch (block-{lb['block_size']} cycle) | | **{lb['batch']}**"
                        f"{'' if lb['exact'] else ' (lower bound)'} | {rep['programs'][-1].get('cache_len')} | | | | | | | | |")
    return "\n".join(rows)


def compile_errors(rep: dict) -> list[str]:
    """The report's programs (and largest-batch probe) that failed to compile for a reason other than HBM capacity."""
    out = [f"{p['name']} (block {p.get('block_size') or '-'}, batch {p['batch']}, cache {p.get('cache_len')}): "
           f"{p['error']}" for p in rep.get("programs", ()) if p.get("compile_error")]
    lb = rep.get("largest_batch") or {}
    if lb.get("compile_error"):
        out.append(f"largest-batch probe: {lb['compile_error']}")
    return out


def _oom_summary(msg: str) -> str:
    m = re.search(r"required for (.*?) \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", msg)
    return f"{m.group(2)} of {m.group(1)} > {m.group(3)}" if m else msg[:80]


def write_json(rep: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
