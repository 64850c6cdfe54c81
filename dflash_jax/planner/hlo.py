"""Compiling one program for a TPU topology: the compiler's memory and cost figures, the collective bytes and the
prefetch double count read from the compiled HLO text, the HBM a program needs, and a program's record in a
report (with its roofline)."""
from __future__ import annotations

import contextlib
import math
import re
import time

import jax

from .topology import Generation


def as_on_tpu(fn):
    """Trace the runtime's programs as they trace on a TPU host (attention.for_tpu: the Pallas kernels,
    compiled), though this host's backend is CPU."""
    import functools

    @functools.wraps(fn)
    def wrapped(*a, **k):
        from ..attention import for_tpu
        with for_tpu():
            return fn(*a, **k)
    return wrapped


def exceeds_hbm(e: Exception) -> bool:
    """Whether a compile failure is the program's HBM need exceeding the chip (the only "does not fit"); anything
    else (a kernel's VMEM overflowing its scoped limit, an unsupported op) is a compile error."""
    s = str(e)
    return "exceeds available HBM" in s or "memory space hbm" in s.lower() or "Ran out of memory on HBM" in s


def _generation(args) -> str | None:
    """The TPU generation ('v5p', 'v5e', 'v6e') of the devices the arguments are placed on, if any."""
    from ..vmem import generation_of
    for a in jax.tree_util.tree_leaves(args):
        sh = getattr(a, "sharding", None)
        if sh is not None and getattr(sh, "device_set", None):
            return generation_of(next(iter(sh.device_set)).device_kind)
    return None


def error_message(e: Exception) -> str:
    """The compiler's message in one line: its first line, and where that only names the error (ends with ':'), the
    sentence that says what overflowed ("Scoped allocation with size 19.61M and limit 16.00M exceeded ...")."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    first = lines[0]
    if first.endswith(":"):
        m = re.search(r"(Scoped allocation .*? by [\d.]+\w?|Used [\d.]+\w? of [\d.]+\w?(?: \w+)?)", " ".join(lines[1:]))
        if m:
            first = f"{first} {m.group(1).strip()}"
    return first[:1000]


_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute", "ragged-all-to-all")
_SHAPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


_ARRAY = re.compile(r"\b(" + "|".join(_SHAPE_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")


def _arrays(shape_text: str):
    """(bytes, memory space) of each array in an HLO shape (an array or a tuple of arrays); the
    memory space is the layout's S(n) (0: HBM)."""
    out = []
    for dt, dims, layout in _ARRAY.findall(shape_text):
        space = _SPACE.search(layout or "")
        out.append((math.prod(int(d) for d in dims.split(",") if d) * _SHAPE_BYTES[dt], int(space.group(1)) if space else 0))
    return out


def collective_bytes(hlo_text: str) -> int:
    """Bytes moved by the collectives of a compiled (SPMD-partitioned, per chip) HLO module: the
    result size of each all-reduce / all-gather / all-to-all / reduce-scatter / collective-permute
    (for the async `-start` forms: the largest array of the result tuple, the destination)."""
    op = re.compile(r"=\s*(.+?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
    total = 0
    for line in hlo_text.splitlines():
        m = op.search(line)
        if not m:
            continue
        sizes = [b for b, _ in _arrays(m.group(1))]
        if sizes:
            total += max(sizes) if m.group(3) else sum(sizes)
    return int(total)


def prefetch_double_count(hlo_text: str) -> int:
    """The part of the compiler's `bytes accessed` that double-counts weight prefetches. The TPU
    compiler copies weights into on-chip memory (VMEM, layout memory space S(1)) ahead of their dots
    (copy-start / copy-done) and its cost analysis counts the copy's source read (HBM, real), the
    copy's output and the dot's read of the on-chip copy (not HBM): a [4096, 4096] weight is counted
    three times where HBM serves it once. Counted here, from the compiled HLO, over the top-level
    instructions of every computation that is not a fusion body: the outputs of copy-start /
    copy-done into on-chip memory and the reads of those copies by other instructions (custom calls
    excepted: a Pallas kernel's figures are its declared cost estimate). Nothing else is taken out,
    so other on-chip traffic (e.g. slices of the KV cache staged in VMEM on v6e) stays counted as
    HBM traffic: the figure errs high, never below the traffic. tests/test_plan.py checks it against
    three dots with one prefetched weight."""
    head = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
    comps: dict[str, list[str]] = {}
    called: set[str] = set()
    cur = None
    for line in hlo_text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if m and not head.match(line):
            cur = m.group(2)
            comps[cur] = []
            continue
        if line.strip() == "}":
            cur = None
            continue
        if cur is not None:
            comps[cur].append(line)
            called.update(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line))
    total = 0
    for name, lines in comps.items():
        if name in called:
            continue
        alias: dict[str, str] = {}  # bitcast / get-tuple-element of a prefetched copy -> the copy
        copies: dict[str, int] = {}  # copy-done results in on-chip memory -> bytes
        for line in lines:
            m = head.match(line)
            if not m:
                continue
            op = re.match(r"(\(.*?\)|\S+)\s+([\w\-]+)\((.*?)\)", m.group(3))
            if not op:
                continue
            shape_text, opcode, operands = op.groups()
            args = re.findall(r"%([\w.\-]+)", operands)
            if opcode == "copy-start":
                arrays = _arrays(shape_text)
                if arrays and arrays[0][1]:  # destination on chip: a prefetch
                    total += sum(b for b, _ in arrays)
            elif opcode == "copy-done":
                arrays = _arrays(shape_text)
                if arrays and arrays[0][1]:
                    total += arrays[0][0]
                    copies[m.group(2)] = arrays[0][0]
            elif opcode in ("bitcast", "get-tuple-element") and args and alias.get(args[0], args[0]) in copies:
                alias[m.group(2)] = alias.get(args[0], args[0])
            elif opcode not in ("custom-call", "parameter", "constant", "tuple"):
                total += sum(copies[alias.get(a, a)] for a in args if alias.get(a, a) in copies)
    return int(total)


def compile_program(jitted, args) -> dict:
    """Lower + compile for the topology; the compiler's memory and cost figures (per chip)."""
    from ..vmem import building_for
    t0 = time.perf_counter()
    gen = _generation(args)
    try:
        with building_for(gen) if gen else contextlib.nullcontext():  # kernels sized for the topology's VMEM
            exe = jitted.lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:  # the compiler's errors: RESOURCE_EXHAUSTED (HBM or VMEM) and others
        out = {"fits": False, "error": error_message(e), "compile_seconds": time.perf_counter() - t0}
        if not exceeds_hbm(e):
            out["compile_error"] = True
        return out
    mem = exe.memory_analysis()
    cost = exe.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    text = exe.as_text()
    out = {"fits": True, "compile_seconds": time.perf_counter() - t0}
    if mem is not None:
        out.update(argument_bytes=int(mem.argument_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
                   output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
                   code_bytes=int(mem.generated_code_size_in_bytes))
    out.update(flops=float(cost.get("flops", float("nan"))), bytes_accessed=float(cost.get("bytes accessed", float("nan"))),
               collective_bytes=float(collective_bytes(text)))
    out["hbm_bytes"] = out["bytes_accessed"] - prefetch_double_count(text)
    return out


def hbm_needed(r: dict) -> int | None:
    """Peak HBM of a compiled program: arguments + temporaries + outputs not aliased to arguments + code."""
    if not r.get("fits"):
        return None
    return r["argument_bytes"] + r["temp_bytes"] + r["output_bytes"] - r["alias_bytes"] + r.get("code_bytes", 0)


def program_record(name, Bk, batch, P, S, mem: dict, cost: dict | None, min_bytes: int, gen: Generation) -> dict:
    """One program's entry in a report: memory and fit from `mem` (the program the runtime runs), flops /
    bytes and the roofline on `gen` from `cost` (its whole-model costing; None: not costed), the minimum
    HBM traffic `min_bytes`."""
    r = {"name": name, "block_size": Bk, "batch": batch, "prompt_len": P, "cache_len": S, "fits": mem["fits"]}
    if mem["fits"]:
        r.update({k: mem[k] for k in ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes")})
    else:
        r.update(argument_bytes=None, temp_bytes=None, output_bytes=None, error=mem["error"])
        if mem.get("compile_error"):
            r["compile_error"] = True
    src = cost if cost is not None and cost.get("fits") else None  # stacked figures count one layer
    if src is not None:
        r["flops"], r["bytes_accessed"] = src["flops"], src["bytes_accessed"]
        r["hbm_bytes"] = src.get("hbm_bytes", src["bytes_accessed"])
        r["collective_bytes"] = src.get("collective_bytes")
        r["roofline_seconds"] = max(src["flops"] / gen.peak_flops, r["hbm_bytes"] / gen.hbm_bandwidth)
    else:
        r["flops"] = r["bytes_accessed"] = r["hbm_bytes"] = r["roofline_seconds"] = None
        if cost is not None and not cost.get("fits"):
            r["cost_error"] = cost.get("error")
    r["min_bytes"] = int(min_bytes)
    r["min_seconds"] = min_bytes / gen.hbm_bandwidth
    if cost is not None and cost.get("method"):
        r["cost_method"] = cost["method"]
    r["compile_seconds"] = round(mem["compile_seconds"] + (cost or {}).get("compile_seconds", 0.0), 2)
    return r

