"""Plan a TPU run before paying for it: compile the project's programs for a TPU topology, anywhere.

With libtpu installed (`pip install "dflash-jax[plan]"`), `jax.experimental.topologies` gives the
devices of a TPU slice without the hardware; the planner builds the very programs that
`generate()` and the trainer run (`generate.decode_programs`: the same shard_map specs, statics and
donation; `Trainer.step_program`) on abstract arguments (`jax.ShapeDtypeStruct` with the runtime's
`NamedSharding`s on that mesh) and runs the real TPU compiler on them. Per program and per chip it
reports the compiler's memory figures (a program that does not fit fails to compile with
RESOURCE_EXHAUSTED, reported as `fits: False` with the compiler's message) and cost figures (flops,
bytes accessed), plus

- `min_bytes`: the physical minimum of HBM traffic: the weights read once (the embedding table
  counts only the rows looked up, unless it is tied to the LM head; a MoE layer only the experts
  its tokens select, expected under uniform routing), the filled KV caches read
  once (filled = prompt + new tokens, at most the cache), the new KV written; a DFlash cycle also
  reads the shared LM head twice (the drafter's logits must exist before the target verifies);
- `roofline_seconds` = max(flops / peak flop rate, bytes_accessed / HBM bandwidth), from the per
  generation figures in `GENERATIONS`;
- `cycle_over_step` per block size: the DFlash cycle's roofline over the target-only step's, which
  is also the break-even tau (a cycle must commit that many tokens on average to match the
  target-only rate);
- the largest batch whose decode cycle fits at the cache length (a search on compiles).

Costing: the compiler counts a while/scan body once, not once per iteration. The decode programs
are compiled twice: with the 'stacked' layer layout the runtime uses on TPU (a scan over layers:
memory and fit come from this one) and with the 'unrolled' layout (every layer its own ops: flops
and bytes are totals over all layers). The cycle is costed by compiling `_cycle`, the body of the
decode loop (one draft + verify), and the target-only step is the Bk=1 cycle without a drafter.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from typing import Sequence

INSTALL_HINT = ('libtpu is not installed: the planner needs the TPU compiler. Install it with '
                '`pip install "dflash-jax[plan]"` (or `pip install "jax[tpu]==<your jax version>"`); '
                'no TPU is needed.')

GiB = 2 ** 30


class PlanError(ValueError):
    """A bad planner input (TPU name, mesh, model config) or a missing libtpu."""


# ----------------------------------------------------------------------------------------------
# TPU generations and slice names
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # prefix of topology names ("v5p", "v5e", "v6e")
    peak_flops: float  # bf16 FLOP/s per chip (Google Cloud TPU spec pages)
    hbm_bandwidth: float  # HBM bytes/s per chip (same source)
    hbm_bytes: int  # HBM per chip as the TPU compiler counts it ("exceeds available HBM (95.74G)")
    gcloud: str  # accelerator-type prefix in gcloud names ("v5p-8", "v5litepod-8", "v6e-8")
    per_core_names: bool  # gcloud's number counts TensorCores (2 per chip) rather than chips


GENERATIONS = {
    "v5p": Generation("v5p", 459e12, 2.765e12, int(95.74 * GiB), "v5p", True),
    "v6e": Generation("v6e", 918e12, 1.640e12, int(31.25 * GiB), "v6e", False),
    "v5e": Generation("v5e", 197e12, 0.819e12, int(15.75 * GiB), "v5litepod", False),
}
# chips -> topology (v5p: a 3-D torus, hosts of 2x2x1 chips; v5e / v6e: 2-D, one host up to 8 chips)
_V5P_SHAPES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
               512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_2D_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Slice:
    accelerator: str  # the gcloud name, e.g. "v5p-8"
    generation: Generation
    topology: str  # e.g. "v5p:2x2x1"
    chips: int
    chips_per_host: tuple[int, int, int]

    @property
    def hosts(self) -> int:
        return self.chips // math.prod(self.chips_per_host)


def valid_tpu_names() -> list[str]:
    out = [f"v5p-{2 * n}" for n in _V5P_SHAPES]
    out += [f"{GENERATIONS[g].gcloud}-{n}" for g in ("v5e", "v6e") for n in _2D_SHAPES]
    return out


def resolve_tpu(name: str) -> Slice:
    """A gcloud accelerator type ("v5p-8", "v5litepod-16", "v6e-8", ...) -> its slice."""
    name = str(name).strip().lower()
    for gen in GENERATIONS.values():
        prefix = gen.gcloud + "-"
        if not name.startswith(prefix) or not name[len(prefix):].isdigit():
            continue
        n = int(name[len(prefix):])
        chips = n // 2 if gen.per_core_names else n
        shapes = _V5P_SHAPES if gen.name == "v5p" else _2D_SHAPES
        if (gen.per_core_names and n % 2) or chips not in shapes:
            break
        dims = tuple(int(x) for x in shapes[chips].split("x"))
        if gen.name == "v5p":
            per_host = (2, 2, 1)
        else:
            per_host = (dims[0], dims[1], 1) if chips <= 8 else (2, 2, 1)
        return Slice(name, gen, f"{gen.name}:{shapes[chips]}", chips, per_host)
    raise PlanError(f"unknown TPU accelerator type {name!r}; valid: {', '.join(valid_tpu_names())}")


def _require_libtpu():
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError(INSTALL_HINT)


def topology_devices(sl: Slice):
    """The slice's TPU devices (abstract: compile-only) from libtpu's topology description."""
    _require_libtpu()
    # libtpu takes a lock file per process; planning only compiles, so several processes may share it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    td = topologies.get_topology_desc(topology_name=sl.topology, platform="tpu",
                                      chips_per_host_bounds=sl.chips_per_host)
    devs = list(td.devices)
    if len(devs) != sl.chips:
        raise PlanError(f"topology {sl.topology} gave {len(devs)} devices, expected {sl.chips} chips")
    return devs


def parse_mesh(text: str | None, chips: int) -> tuple[int, int]:
    """"data=D,model=M" (either may be left out) -> (data, model); default: the runtime's rule
    (model 1, data = every chip), as `--model-parallel 1` in the CLIs and mesh.model: 1 in training."""
    data, model = None, 1
    if text:
        for part in str(text).split(","):
            k, sep, v = part.partition("=")
            k = k.strip()
            if not sep or k not in ("data", "model") or not v.strip().isdigit() or int(v) < 1:
                raise PlanError(f"bad --mesh {text!r}: expected data=D,model=M with positive integers")
            if k == "data":
                data = int(v)
            else:
                model = int(v)
    if chips % model:
        raise PlanError(f"mesh model={model} does not divide the slice's {chips} chips")
    data = chips // model if data is None else data
    if data * model != chips:
        raise PlanError(f"mesh data={data} x model={model} = {data * model} != the slice's {chips} chips")
    return data, model


def check_layout(tcfg, dcfg, data: int, model: int) -> None:
    """The runtime's divisibility rules (sharding.target_layout / drafter_layout) for this mesh."""
    import types
    from .sharding import drafter_layout, target_layout
    shape = types.SimpleNamespace(shape={"data": data, "model": model})
    try:
        target_layout(tcfg, shape)
        if dcfg is not None:
            drafter_layout(dcfg, shape)
    except ValueError as e:
        raise PlanError(f"mesh data={data},model={model}: {e}") from None


def make_mesh(devices, data: int, model: int):
    from .sharding import make_mesh as mk
    return mk(data, model, devices=devices)


# ----------------------------------------------------------------------------------------------
# Abstract models and caches
# ----------------------------------------------------------------------------------------------
def abstract_params(kind: str, config, mesh, layout: str = "stacked") -> dict:
    """ShapeDtypeStructs of a Target's / Drafter's params, laid out on `mesh` as the runtime does
    (sharding.param_spec; KV heads replicated when the model axis exceeds them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from . import drafter as drafter_mod
    from . import model as model_mod
    from .sharding import drafter_layout, param_spec, target_layout
    from .weights import replicated_shape

    shapes = (model_mod if kind == "target" else drafter_mod).param_shapes(config)
    rep, _ = (target_layout if kind == "target" else drafter_layout)(config, mesh)
    dt = jnp.dtype(config.dtype)

    def sds(path, shape):
        g = replicated_shape(path[-1], shape, rep)
        return jax.ShapeDtypeStruct(g, dt, sharding=NamedSharding(mesh, param_spec(path, kind)))

    params = {k: sds((k,), s) for k, s in shapes.items() if k != "layers"}
    layers = shapes["layers"]
    if layout == "unrolled":
        n = next(iter(layers.values()))[0]
        params["layers"] = tuple({k: sds(("layers", i, k), s[1:]) for k, s in layers.items()} for i in range(n))
    elif layout == "stacked":
        params["layers"] = {k: sds(("layers", k), s) for k, s in layers.items()}
    else:
        raise PlanError(f"unknown layout {layout!r}")
    return params


def bytes_per_chip(tree) -> int:
    """Bytes one chip holds for a tree of ShapeDtypeStructs with NamedShardings."""
    import jax
    import numpy as np
    total = 0
    for a in jax.tree_util.tree_leaves(tree):
        total += int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
    return total


def _local(mesh, spec, shape) -> tuple:
    from jax.sharding import NamedSharding
    return NamedSharding(mesh, spec).shard_shape(tuple(shape))


def _with_specs(tree, specs, mesh):
    """Attach NamedShardings (from a matching PartitionSpec tree) to a tree of ShapeDtypeStructs."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.tree_util.tree_map(
        lambda spec, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        specs, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


# ----------------------------------------------------------------------------------------------
# Compiling one program
# ----------------------------------------------------------------------------------------------
def _is_oom(e: Exception) -> bool:
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s or "Ran out of memory" in s or "exceeds available HBM" in s


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    for line in s.splitlines():
        if line.strip():
            return line.strip()[:1000]
    return type(e).__name__


_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute", "ragged-all-to-all")
_SHAPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}


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
    t0 = time.perf_counter()
    try:
        exe = jitted.lower(*args).compile()
    except Exception as e:  # jax.errors.JaxRuntimeError (XlaRuntimeError) on RESOURCE_EXHAUSTED
        if _is_oom(e):
            return {"fits": False, "error": _first_line(e), "compile_seconds": time.perf_counter() - t0}
        raise
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


# ----------------------------------------------------------------------------------------------
# Decode programs (prefill, target-only step, DFlash cycle)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    target_config: object  # TargetConfig (dtype = the run's dtype)
    drafter_config: object | None  # DrafterConfig or None
    mesh: object
    batch: int  # global batch, padded to a multiple of the data axis as generate() does
    prompt_len: int
    max_new_tokens: int
    cache_len: int | None  # None: generate()'s rule per block size


class _Decode:
    """Abstract arguments + compiled figures of the decode programs for one batch / cache."""

    def __init__(self, setup: DecodeSetup):
        self.s = setup

    def models(self, Bk: int, layout: str):
        """Abstract (target, drafter or None: Bk = 1 is target-only decoding)."""
        from .drafter import Drafter
        from .model import Target
        s = self.s
        tc, dc = s.target_config, s.drafter_config
        target = Target(params=abstract_params("target", tc, s.mesh, layout), config=tc)
        drafter = None
        if Bk > 1:
            drafter = Drafter(params=abstract_params("drafter", dc, s.mesh, layout), config=dc)
        return target, drafter

    def shapes(self, Bk: int, batch: int | None = None, tree: int | None = None):
        from .generate import prompt_and_cache_len
        s = self.s
        width = Bk if tree is None else max(Bk, tree + 1)  # slots one verification writes
        P, S = prompt_and_cache_len(s.prompt_len, s.max_new_tokens, width, s.cache_len)
        return (batch or s.batch), P, S

    def args(self, kind: str, Bk: int, layout: str, batch: int | None = None, tree: int | None = None):
        """(jitted program, abstract args) of kind prefill / cycle for block size Bk (1 = target only);
        `tree`: the cycle verifies a draft tree of that many nodes."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as PS

        from .generate import _program, _state_specs, decode_programs, stop_width
        from .sampling import SamplingParams
        s = self.s
        B, P, S = self.shapes(Bk, batch, tree)
        target, drafter = self.models(Bk, layout)
        progs = decode_programs(target, drafter, s.mesh, S=S, Bk=Bk, sp=SamplingParams(0.0, 0, 1.0), tree=tree)

        def sds(shape, dtype, spec):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(s.mesh, spec))

        K = stop_width(len(s.target_config.eos_token_ids))
        t_spec, l_spec, r_spec, stop_spec, b_spec = progs["row_specs"]
        tokens, lens = sds((B, P), jnp.int32, t_spec), sds((B,), jnp.int32, l_spec)
        rows, stop = sds((B,), jnp.int32, r_spec), sds((B, K), jnp.int32, stop_spec)
        budget = sds((B,), jnp.int32, b_spec)
        key = sds((2,), jnp.uint32, PS())
        pre_fn, pre_statics, pre_donate, pre_specs = progs["prefill"]
        pre = _program(pre_fn, pre_statics, pre_donate, s.mesh, pre_specs)
        pre_args = (target, drafter, tokens, lens, rows, key, stop, budget)
        if kind == "prefill":
            return pre, pre_args
        state = _with_specs(jax.eval_shape(pre, *pre_args), _state_specs(drafter is not None), s.mesh)
        fn, statics, donate, specs = progs[kind]
        return _program(fn, statics, donate, s.mesh, specs), (target, drafter, state, rows, key, stop, budget)

    # ---- the physical minimum of HBM traffic (per chip) ----
    def min_bytes(self, kind: str, Bk: int, batch: int | None = None, tree: int | None = None) -> int:
        import jax.numpy as jnp
        from .sharding import cache_spec
        s = self.s
        B, P, S = self.shapes(Bk, batch, tree)
        target, drafter = self.models(Bk, "stacked")
        tc = s.target_config
        dt = jnp.dtype(tc.dtype).itemsize
        B_loc = _local(s.mesh, cache_spec().lengths, (B,))[0]
        new = P if kind == "prefill" else (Bk if tree is None else tree + 1)
        filled = 0 if kind == "prefill" else min(S, s.prompt_len + s.max_new_tokens)

        def weights(params, tokens):
            total = bytes_per_chip(params)
            emb = params.get("embed")
            if emb is not None and not tc.tie_word_embeddings:  # a lookup reads only the rows it needs
                rows = min(_local(s.mesh, emb.sharding.spec, emb.shape)[0], tokens)
                total -= bytes_per_chip(emb) - rows * emb.shape[1] * dt
            if tc.num_experts:  # MoE: only the experts the tokens select are read
                experts = expert_bytes_per_chip(params["layers"])
                total -= experts - experts * expected_expert_fraction(tc.num_experts, tc.num_experts_per_tok, tokens)
            return int(total)

        def kv(model, L, slots):  # K and V of `slots` positions, all layers, local rows and heads
            from .layers import first_layer, kv_heads
            D = model.config.head_dim
            kv_loc = _local(s.mesh, cache_spec().k, (L, B, kv_heads(first_layer(model.params["layers"]), D), 1, D))
            return 2 * int(math.prod(kv_loc)) * slots * dt

        total = weights(target.params, B_loc * new) + kv(target, tc.num_layers, filled + new)
        if drafter is not None:  # + the shared LM head read again: the drafter's logits precede the verify
            head = target.params["embed" if tc.tie_word_embeddings else "lm_head"]
            total += (bytes_per_chip(drafter.params) + bytes_per_chip(head)
                      + kv(drafter, drafter.config.num_layers, filled + new))
        return total


def expected_expert_fraction(E: int, k: int, tokens: int) -> float:
    """The share of a MoE layer's experts that `tokens` tokens select (top-k each), expected under
    uniform routing: 1 - (1 - k/E)^tokens. Exact for one token (k of E); a verify block of T tokens
    reads up to min(E, T k) experts, which is why a MoE cycle costs more target steps than a dense one."""
    return 1.0 - (1.0 - k / E) ** max(int(tokens), 0)


def expert_bytes_per_chip(layers) -> int:
    from .moe import EXPERT_KEYS
    import jax
    leaves = jax.tree_util.tree_leaves_with_path(layers)
    return sum(bytes_per_chip(a) for path, a in leaves
               if str(getattr(path[-1], "key", "")) in EXPERT_KEYS and str(path[-1].key) not in ("router", "router_bias"))


COST_METHODS = ("layers", "full")


def layer_period(tc) -> int | None:
    """The smallest p such that target layer i is built like layer i mod p (dense / MoE MLP, sliding
    window) and p divides the depth; None when the layers follow no such pattern."""
    L = tc.num_layers
    sig = [(tc.is_sparse(i), tc.layer_windows[i] if tc.layer_windows else 0) for i in range(L)]
    for p in range(1, L + 1):
        if L % p == 0 and all(sig[i] == sig[i % p] for i in range(L)):
            return p
    return None


def _with_target_layers(dec: "_Decode", n: int) -> "_Decode":
    """The same decode setup on the first n target layers (the drafter taps layer 0 only, so that
    two depths differ by whole untapped layers)."""
    s = dec.s
    tc = s.target_config
    kw = {"num_layers": n}
    for name in ("sparse_layers", "layer_windows"):
        if getattr(tc, name):
            kw[name] = tuple(getattr(tc, name)[:n])
    dc = s.drafter_config
    if dc is not None:
        dc = dataclasses.replace(dc, num_target_layers=n, target_layer_ids=(0,) * len(dc.target_layer_ids))
    return _Decode(dataclasses.replace(s, target_config=dataclasses.replace(tc, **kw), drafter_config=dc))


def unrolled_cost(dec: "_Decode", kind: str, Bk: int, tree: int | None = None, method: str = "full") -> dict:
    """Whole-model flops / bytes accessed, from programs with the 'unrolled' layer layout (each layer
    its own ops): the runtime's 'stacked' program scans over layers, and the compiler costs a loop
    body once, not once per layer.

    method "full" (default): compile the whole unrolled model (the compiler's own figure for the
    program; 25 s to 7 min per program for an 8B model, longest at 32k caches).
    method "layers": compile it at 3p and 4p target layers (p: the period of the layer pattern, 1 for
    uniform models, 2 for alternating windows) and extend by the compiler's per-p-layer difference:
    cost(L) = cost(4p) + (L/p - 4) (cost(4p) - cost(3p)). A quick estimate only: flops extend exactly,
    bytes do not, because the compiler's prefetch and layout choices differ from layer to layer
    (measured, Qwen3-8B on v5p: per-layer differences of 0.19-0.73 GB at depths 3-8 where the full
    model averages 0.47; the extension was 20-110% above the full compile at caches 8k and 32k,
    reports/tpu_plan/README.md). Falls back to "full" for models without a period or as shallow as 4p."""
    if method not in COST_METHODS:
        raise PlanError(f"unknown cost method {method!r}; use one of {COST_METHODS}")
    import contextlib

    from .attention import count_every_block
    # decode programs: the blockwise attention loop unrolled, so every KV block of the cache is
    # counted (the compiler counts a loop body once); prefill keeps its loops (see plan())
    s = dec.s
    fill = s.prompt_len + s.max_new_tokens  # the longest fill a decode cycle of this plan sees
    with count_every_block(fill) if kind == "cycle" else contextlib.nullcontext():
        return _unrolled_cost(dec, kind, Bk, tree, method)


def _unrolled_cost(dec: "_Decode", kind: str, Bk: int, tree: int | None, method: str) -> dict:
    L = dec.s.target_config.num_layers
    p = layer_period(dec.s.target_config) if method == "layers" else None
    if p is None or L <= 4 * p:
        out = compile_program(*dec.args(kind, Bk, "unrolled", tree=tree))
        out["method"] = "unrolled layers"
        return out
    c3 = compile_program(*_with_target_layers(dec, 3 * p).args(kind, Bk, "unrolled", tree=tree))
    c4 = compile_program(*_with_target_layers(dec, 4 * p).args(kind, Bk, "unrolled", tree=tree))
    out = {"fits": c3["fits"] and c4["fits"], "compile_seconds": c3["compile_seconds"] + c4["compile_seconds"],
           "method": f"unrolled, {3 * p} and {4 * p} target layers, extended to {L}"}
    if not out["fits"]:
        out["error"] = (c3 if not c3["fits"] else c4)["error"]
        return out
    for k in ("flops", "bytes_accessed", "hbm_bytes", "collective_bytes"):
        out[k] = c4[k] + (L // p - 4) * (c4[k] - c3[k])
    return out


def _program_record(name, Bk, batch, P, S, mem: dict, cost: dict | None, min_bytes: int, gen: Generation) -> dict:
    r = {"name": name, "block_size": Bk, "batch": batch, "prompt_len": P, "cache_len": S, "fits": mem["fits"]}
    if mem["fits"]:
        r.update({k: mem[k] for k in ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes")})
    else:
        r.update(argument_bytes=None, temp_bytes=None, output_bytes=None, error=mem["error"])
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


# ----------------------------------------------------------------------------------------------
# Model configs
# ----------------------------------------------------------------------------------------------
def load_target_config(path: str, dtype: str = "bfloat16"):
    from .config import TargetConfig, read_config_json
    if not os.path.exists(path):
        raise PlanError(f"target config {path} does not exist (a directory with config.json, or the file)")
    return TargetConfig.from_hf(read_config_json(path), dtype=dtype)


def make_drafter_config(target_config, drafter: str | None = None, num_layers: int = 5, block_size: int = 16,
                        mask_token_id: int | None = None):
    """The drafter's config from a z-lab config.json, else DFlash's default shape for this target."""
    from .config import DrafterConfig, read_config_json
    from .drafter import check_compatible, drafter_config_for
    from .model import Target
    shell = Target(params={}, config=target_config)
    if drafter:
        if not os.path.exists(drafter):
            raise PlanError(f"drafter config {drafter} does not exist")
        dc = DrafterConfig.from_hf(read_config_json(drafter), dtype=target_config.dtype)
    else:
        mask = target_config.vocab_size - 1 if mask_token_id is None else mask_token_id
        dc = drafter_config_for(shell, num_layers, block_size, mask)
    check_compatible(dc, shell)
    return dc


# ----------------------------------------------------------------------------------------------
# The planner
# ----------------------------------------------------------------------------------------------
def _header(sl: Slice, data: int, model: int) -> dict:
    return {"tpu": sl.accelerator, "topology": sl.topology, "chips": sl.chips, "hosts": sl.hosts,
            "mesh": {"data": data, "model": model}, "hbm_bytes_per_chip": sl.generation.hbm_bytes,
            "peak_flops_per_chip": sl.generation.peak_flops, "hbm_bandwidth_per_chip": sl.generation.hbm_bandwidth}


def _as_on_tpu(fn):
    """Trace the runtime's programs as they trace on a TPU host (attention.for_tpu: the Pallas kernels,
    compiled), though this host's backend is CPU."""
    import functools

    @functools.wraps(fn)
    def wrapped(*a, **k):
        from .attention import for_tpu
        with for_tpu():
            return fn(*a, **k)
    return wrapped


@_as_on_tpu
def plan(target: str, tpu: str = "v5p-8", *, drafter: str | None = None, drafter_layers: int = 5,
         block_size: int = 16, block_sizes: Sequence[int] | None = None, mesh: str | None = None, batch: int = 1,
         prompt_len: int = 1024, max_new_tokens: int = 256, cache_len: int | None = None, dtype: str = "bfloat16",
         prefill: bool = True, target_step: bool = True, largest_batch: bool = True, max_probes: int = 8,
         cost: bool = True, log=None, tree_budgets: Sequence[int] = (), cost_method: str = "full",
         moe_combine: str = "psum") -> dict:
    """Compile prefill, the target-only step and the DFlash cycle (per block size) for a TPU slice;
    with `tree_budgets`, also the tree-verification cycle (N draft nodes at the drafter's block).

    target / drafter: a config.json (or its directory); without `drafter`, a DFlash drafter of
    `drafter_layers` layers and block `block_size` for this target. block_sizes: the cycle's block
    sizes (default: the drafter's). cache_len: KV slots per row (default: generate()'s rule from
    prompt_len + max_new_tokens + block). cost: also compile each program with unrolled layers for
    whole-model flops / bytes (False: memory and fit only, faster); cost_method: see unrolled_cost
    ("full": the whole unrolled model; "layers": 3 and 4 layer periods, extended, a rough estimate). moe_combine:
    how expert-parallel MoE blocks return their outputs ("psum" or "all_to_all", see dflash_jax.moe).
    Returns the JSON-able report (see infer/plan.py)."""
    log = log or (lambda *_: None)
    sl = resolve_tpu(tpu)
    data, model = parse_mesh(mesh, sl.chips)
    if batch < 1 or prompt_len < 1 or max_new_tokens < 1:
        raise PlanError("batch, prompt_len and max_new_tokens must be >= 1")
    if dtype not in ("bfloat16", "float32"):
        raise PlanError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    tcfg = load_target_config(target, dtype)
    if moe_combine not in ("psum", "all_to_all"):
        raise PlanError(f"moe_combine must be 'psum' or 'all_to_all', got {moe_combine!r}")
    tcfg = dataclasses.replace(tcfg, moe_combine=moe_combine)
    dcfg = make_drafter_config(tcfg, drafter, drafter_layers, block_size)
    blocks = tuple(int(b) for b in (block_sizes or (dcfg.block_size,)))
    for b in blocks:
        if not 2 <= b <= dcfg.block_size:
            raise PlanError(f"block size {b} outside [2, {dcfg.block_size}] for this drafter")
    if prompt_len > tcfg.max_position_embeddings:
        raise PlanError(f"prompt_len {prompt_len} exceeds the model's max_position_embeddings "
                        f"({tcfg.max_position_embeddings})")
    check_layout(tcfg, dcfg, data, model)
    m = make_mesh(topology_devices(sl), data, model)
    B = -(-batch // data) * data  # generate() pads the batch to a multiple of the data axis
    dec = _Decode(DecodeSetup(tcfg, dcfg, m, B, prompt_len, max_new_tokens, cache_len))
    for b in (1,) + blocks:
        dec.shapes(b)  # validates the cache length for every block size before compiling anything
    gen = sl.generation
    report = _header(sl, data, model)
    report.update(target=os.path.abspath(target), dtype=dtype, requested_batch=batch,
                  drafter={"num_layers": dcfg.num_layers, "block_size": dcfg.block_size,
                           "target_layer_ids": list(dcfg.target_layer_ids)},
                  max_new_tokens=max_new_tokens, programs=[])
    if tcfg.num_experts:
        report["moe_combine"] = moe_combine

    def run(name, kind, Bk, tree=None):
        Bq, P, S = dec.shapes(Bk, tree=tree)
        log(f"compiling {name}" + (f" (block {Bk})" if name == "cycle" else "")
            + (f" ({tree} nodes)" if tree else "") + f", batch {Bq}, cache {S} ...")
        mem = compile_program(*dec.args(kind, Bk, "stacked", tree=tree))
        c = unrolled_cost(dec, kind, Bk, tree=tree, method=cost_method) if cost and mem["fits"] else None
        rec = _program_record(name, Bk if Bk > 1 else (1 if name == "target_step" else None), Bq,
                              P, S, mem, c, dec.min_bytes(kind, Bk, tree=tree), gen)
        if tree:
            rec["tree_budget"] = int(tree)
        if name == "prefill":
            rec["block_size"] = max(blocks)
            from .generate import PREFILL_CHUNK
            if P > PREFILL_CHUNK and rec.get("flops") is not None:
                rec["cost_note"] = (f"flops / bytes accessed of one {PREFILL_CHUNK}-token chunk of {-(-P // PREFILL_CHUNK)}: "
                                    "the compiler costs the chunk loop's body once")
        report["programs"].append(rec)
        return rec

    if prefill:
        run("prefill", "prefill", max(blocks))
    step = run("target_step", "cycle", 1) if target_step else None
    cycles = {b: run("cycle", "cycle", b) for b in blocks}
    report["cycle_over_step"] = {}
    if step is not None and step.get("roofline_seconds"):
        for b, r in cycles.items():
            if r.get("roofline_seconds"):
                report["cycle_over_step"][str(b)] = r["roofline_seconds"] / step["roofline_seconds"]
    report["break_even_tau"] = dict(report["cycle_over_step"])
    trees = {n: run("tree_cycle", "cycle", dcfg.block_size, tree=int(n)) for n in tree_budgets}
    if trees:
        report["tree_cycle_over_step"] = {
            str(n): r["roofline_seconds"] / step["roofline_seconds"] for n, r in trees.items()
            if step is not None and step.get("roofline_seconds") and r.get("roofline_seconds")}
    if largest_batch:
        b = max(blocks)
        report["largest_batch"] = largest_fitting_batch(dec, b, data, cycles[b], gen.hbm_bytes, max_probes, log)
    return report


def largest_fitting_batch(dec: _Decode, Bk: int, step: int, first: dict, hbm: int, max_probes: int = 8,
                          log=None) -> dict:
    """The largest batch (a multiple of the data axis, `step`) whose cycle compiles within HBM at
    this cache length.

    Memory is affine in the batch (caches and activations grow with it, weights do not), so once
    two sizes fit, the line through them gives the next guess (where it reaches `hbm`); otherwise
    the batch doubles until one does not fit, then bisection between the largest batch known to fit
    and the smallest known not to. Each probe is one compile, at most `max_probes`. `exact` is true
    when the next multiple of `step` is known not to fit."""
    log = log or (lambda *_: None)
    known: dict[int, int | None] = {dec.s.batch: hbm_needed(first)}
    probes = 0
    while True:
        fit = sorted(b for b, v in known.items() if v is not None)
        nofit = sorted(b for b, v in known.items() if v is None)
        lo, hi = (fit[-1] if fit else 0), (nofit[0] if nofit else None)
        if (hi is not None and hi - lo <= step) or probes >= max_probes:
            break
        guess = None
        if len(fit) >= 2:
            b1, b2 = fit[-2], fit[-1]
            slope = (known[b2] - known[b1]) / (b2 - b1)
            if slope > 0:
                guess = b2 + int((hbm - known[b2]) / slope) // step * step
        if hi is None:
            if guess is None:
                guess = 2 * lo
            elif guess <= lo:  # the line says full, yet it fit: the compiler packs better; step up by ~1/8
                guess = lo + max(step, lo // 8 // step * step)
            else:
                guess = min(guess, 64 * lo)
        elif guess is not None and guess <= lo and len(fit) >= 2 and fit[-1] == lo:
            guess = lo + step  # the line puts the limit at the largest fitting batch: confirm the next one
        elif guess is None or not lo < guess < hi:
            guess = max((lo + hi) // 2 // step * step, lo + step)
        probes += 1
        log(f"  largest batch: compiling the block-{Bk} cycle at batch {guess} ...")
        known[guess] = hbm_needed(compile_program(*dec.args("cycle", Bk, "stacked", batch=guess)))
    return {"program": "cycle", "block_size": Bk, "batch": lo, "exact": hi is not None and hi - lo <= step,
            "smallest_not_fitting": hi, "probes": probes}


# ----------------------------------------------------------------------------------------------
# Training step
# ----------------------------------------------------------------------------------------------
def drafter_config_for_train(cfg, tcfg):
    from .training.pipeline import drafter_config
    return drafter_config(cfg, tcfg, cfg.train.param_dtype)


def _train_setup(cfg, tcfg, mesh, *, layout: str = "stacked", grad_accum: int | None = None,
                 loss_chunk: int | None = None, anchor_chunk: int | None = None, num_anchors: int | None = None):
    """(jitted step, abstract args, shapes) of the trainer's optimizer step for this YAML, built as
    pipeline.train builds it (objective with the YAML's loss / anchor chunks and remat policy, optimizer,
    frozen-target shardings, ZeRO shardings of the AdamW state, Trainer.step_program)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    from . import model as model_mod
    from .layers import with_layout
    from .model import Target
    from .training.blocks import default_buckets
    from .training.loss import DrafterObjective
    from .training.optim import make_optimizer
    from .training.pipeline import drafter_config, frozen_target_shardings
    from .training.trainer import TrainState, Trainer
    from . import drafter as drafter_mod

    t = cfg.train
    dcfg_master = drafter_config(cfg, tcfg, t.param_dtype)
    dcfg = dataclasses.replace(dcfg_master, dtype=t.compute_dtype)
    repl = NamedSharding(mesh, PS())

    def tree(shapes, dtype, sharding=None):
        dt = jnp.dtype(dtype)
        out = {k: jax.ShapeDtypeStruct(v, dt, sharding=sharding) for k, v in shapes.items() if k != "layers"}
        layers = {k: jax.ShapeDtypeStruct(v, dt, sharding=sharding) for k, v in shapes["layers"].items()}
        if layout == "unrolled":
            n = next(iter(shapes["layers"].values()))[0]
            layers = tuple({k: jax.ShapeDtypeStruct(v.shape[1:], dt, sharding=sharding) for k, v in layers.items()}
                           for _ in range(n))
        out["layers"] = layers if layout == "unrolled" else with_layout(layers, "stacked")
        return out

    target = Target(params=tree(model_mod.param_shapes(tcfg), tcfg.dtype), config=tcfg)
    params0 = tree(drafter_mod.param_shapes(dcfg_master), t.param_dtype, repl)
    steps = t.steps or 1000  # the schedule's length does not change the program
    tx, lr_fn = make_optimizer(cfg.optimizer, steps)
    objective = DrafterObjective(dcfg, cfg.gamma, loss_chunk or t.loss_chunk, anchor_chunk or t.anchor_chunk,
                                 t.remat)
    trainer = Trainer(objective, params0, target, tx, mesh=mesh, schedule=lr_fn, param_dtype=t.param_dtype,
                      frozen_shardings=frozen_target_shardings(target, mesh), zero1=t.zero1)
    opt = jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                 jax.eval_shape(tx.init, params0), trainer.opt_shardings)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl), params=params0, opt_state=opt,
                       rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl))
    buckets = sorted(t.length_buckets) if t.length_buckets else default_buckets(cfg.data.max_length)
    T, A, R = int(max(buckets)), num_anchors or t.num_anchors, t.batch_size
    acc = grad_accum or t.grad_accum
    shapes = {"tokens": ((acc, R, T), jnp.int32), "lengths": ((acc, R), jnp.int32),
              "anchor_pos": ((acc, R, A), jnp.int32), "anchor_valid": ((acc, R, A), jnp.bool_)}
    batch = {k: jax.ShapeDtypeStruct(sh, dt, sharding=trainer.batch_sharding(len(sh), True))
             for k, (sh, dt) in shapes.items()}
    info = {"seq_len": T, "num_anchors": A, "micro_batch": R, "grad_accum": t.grad_accum,
            "block_size": dcfg.block_size, "drafter_layers": dcfg.num_layers}
    return trainer.step_program(state), (state, trainer.frozen, batch), info, (target, params0, opt)


def train_model_flops(tcfg, dcfg, seq_len: int, num_anchors: int) -> float:
    """Useful flops of one training sequence (no recomputation), the numerator of MFU.

    Target forward up to its last tapped layer (2 x active weights x tokens, causal attention);
    drafter forward + backward (6 x weights x block tokens, the context projection and K/V over the
    sequence, block attention over half the sequence on average); the frozen lm_head forward and its
    input gradient (4 x H x V per predicted position)."""
    def attn_w(c):
        return c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)

    def mlp_w(c, moe=False):
        if moe and getattr(c, "num_experts", 0):
            return 3 * c.hidden_size * c.moe_intermediate_size * c.num_experts_per_tok
        return 3 * c.hidden_size * c.intermediate_size

    T, A, B = seq_len, num_anchors, dcfg.block_size
    Lt = max(dcfg.target_layer_ids) + 1
    target = Lt * (2 * T * (attn_w(tcfg) + mlp_w(tcfg, True)) + 2 * T * T * tcfg.num_heads * tcfg.head_dim)
    H, kv = dcfg.hidden_size, dcfg.num_kv_heads * dcfg.head_dim
    blocks = A * B
    per_layer = (2 * blocks * (attn_w(dcfg) + mlp_w(dcfg))  # block tokens through the layer
                 + 2 * T * 2 * H * kv  # context K/V projections
                 + 4 * blocks * (T / 2 + B) * dcfg.num_heads * dcfg.head_dim)  # scores + values
    drafter = 3 * (dcfg.num_layers * per_layer + 2 * T * len(dcfg.target_layer_ids) * H * H)  # + fc
    head = 4 * H * tcfg.vocab_size * A * (B - 1)
    return float(target + drafter + head)


def _random_target_config(spec, dtype: str):
    from .config import TargetConfig
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.family]
    return TargetConfig.from_hf({"architectures": [arch], "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
                                 "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
                                 "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                                 "head_dim": spec.head_dim}, dtype=dtype)


@_as_on_tpu
def plan_train(config: str, tpu: str = "v5p-8", *, target: str | None = None, mesh: str | None = None,
               overrides: Sequence[str] = (), cost: bool = True, log=None) -> dict:
    """Compile the trainer's optimizer step of a training YAML for a TPU slice.

    target: the target's config.json (or directory), overriding `target.path` (needed when that is
    a hub id). mesh: "data=D,model=M" (default: the YAML's mesh section). overrides: YAML overrides
    ("train.batch_size=32"). Memory and fit come from the step the trainer runs (stacked layers,
    grad_accum micro-batches scanned, anchors and loss in chunks, remat, ZeRO shardings).

    cost: flops / bytes per step. A loop body is costed once, so they come from loop-free variants of
    the same step (unrolled layers, one micro-batch, all anchors in one attention and one loss chunk)
    compiled at two anchor counts a1 < a2 (64 and 128 by default): the target's forward does not
    depend on the anchors and the drafter's work is linear in them, so cost(A) = cost(a1) +
    (A - a1) / (a2 - a1) * (cost(a2) - cost(a1)), times grad_accum. From them: the roofline step
    time max(flops / peak, HBM bytes / bandwidth), sequences per second, the ratio of the compiled flops
    to the model flops (train_model_flops; recomputation shows here) and the implied MFU at the
    roofline (model flops / (peak x roofline time))."""
    log = log or (lambda *_: None)
    from .training.config import load_config
    sl = resolve_tpu(tpu)
    if not os.path.exists(config):
        raise PlanError(f"training config {config} does not exist")
    cfg = load_config(config, list(overrides))
    tpath = target or cfg.target.path
    if os.path.exists(tpath):
        tcfg = load_target_config(tpath, cfg.target.dtype)
    elif cfg.target.random_init is not None:  # the random target the pipeline would create there
        tcfg = _random_target_config(cfg.target.random_init, cfg.target.dtype)
    else:
        raise PlanError(f"target.path {tpath!r} is not a local config; pass --target <config.json or its directory>")
    if mesh is None and (cfg.mesh.data is not None or cfg.mesh.model != 1):
        mesh = f"model={cfg.mesh.model}" + (f",data={cfg.mesh.data}" if cfg.mesh.data is not None else "")
    data, model = parse_mesh(mesh, sl.chips)
    check_layout(tcfg, None, data, model)
    if cfg.train.batch_size % data:
        raise PlanError(f"train.batch_size {cfg.train.batch_size} is not divisible by the mesh data axis ({data})")
    m = make_mesh(topology_devices(sl), data, model)
    gen = sl.generation
    report = _header(sl, data, model)
    log(f"compiling the training step of {config} ...")
    jitted, args, info, (_, params0, opt) = _train_setup(cfg, tcfg, m)
    mem = compile_program(jitted, args)
    acc = info["grad_accum"]
    A = info["num_anchors"]
    c = None
    if cost and mem["fits"]:
        a1 = min(64, max(1, A // 2))
        a2 = min(2 * a1, A)
        pts = {}
        for a in sorted({a1, a2}):
            log(f"compiling its loop-free single-micro-batch variant at {a} anchors for flops / bytes ...")
            j2, args2, _, _ = _train_setup(cfg, tcfg, m, layout="unrolled", grad_accum=1, loss_chunk=a,
                                           anchor_chunk=a, num_anchors=a)
            pts[a] = compile_program(j2, args2)
        if all(p["fits"] for p in pts.values()):
            keys = ("flops", "bytes_accessed", "hbm_bytes", "collective_bytes")
            if a2 > a1:
                c = {k: pts[a1][k] + (A - a1) / (a2 - a1) * (pts[a2][k] - pts[a1][k]) for k in keys}
            else:
                c = {k: pts[a1][k] for k in keys}
            c = {k: v * acc for k, v in c.items()}
            c.update(fits=True, method=f"loop-free variants at {a1} and {a2} anchors, extended to {A}, x grad_accum "
                                      f"{acc}")
            points = {a: pts[a]["flops"] for a in sorted(pts)}  # one micro-batch's flops per anchor count compiled
    # physical minimum per step: the frozen target read once per micro-batch, the drafter's master
    # weights and AdamW moments read and written once
    min_bytes = acc * bytes_per_chip(args[1].params) + 2 * (
        bytes_per_chip(params0) + bytes_per_chip(opt))
    rec = _program_record("train_step", info["block_size"], cfg.train.batch_size, None, None, mem, c, min_bytes, gen)
    rec["prompt_len"] = None
    rec["seq_len"] = info["seq_len"]
    rec["grad_accum"] = acc
    if c is not None:
        rec["flops_at_anchors"] = points
    per_chip = cfg.train.batch_size // data
    need = hbm_needed(mem)
    train = dict(info, config=config, per_chip=per_chip, sequences_per_step=cfg.train.batch_size * acc)
    if need is not None:
        train["hbm_needed_bytes"] = need
        train["hbm_spare_fraction"] = 1.0 - need / gen.hbm_bytes
    rl = rec.get("roofline_seconds")
    dcfg = drafter_config_for_train(cfg, tcfg)
    train["model_flops_per_sequence"] = train_model_flops(tcfg, dcfg, info["seq_len"], A)
    if rl:
        seqs_chip = per_chip * acc  # sequences one chip trains per step
        train["sequences_per_second"] = cfg.train.batch_size * acc / rl
        train["mfu_at_roofline"] = train["model_flops_per_sequence"] * seqs_chip / (gen.peak_flops * rl)
        train["compiled_over_model_flops"] = rec["flops"] / (train["model_flops_per_sequence"] * seqs_chip)
        train["bound"] = "compute" if rec["flops"] / gen.peak_flops >= rec["hbm_bytes"] / gen.hbm_bandwidth else "HBM"
    report["programs"] = [rec]
    report["cycle_over_step"] = {}
    report["train"] = train
    report["target"] = os.path.abspath(tpath)
    return report


# ----------------------------------------------------------------------------------------------
# Human-readable summary
# ----------------------------------------------------------------------------------------------
def _gb(x):
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def _gib(x):
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def format_report(rep: dict) -> str:
    lines = [f"{rep['tpu']} ({rep['topology']}, {rep['chips']} chips, {rep['hosts']} host(s)), mesh data="
             f"{rep['mesh']['data']} model={rep['mesh']['model']}, HBM {_gib(rep['hbm_bytes_per_chip'])} per chip"
             + (f", MoE combine {rep['moe_combine']}" if rep.get("moe_combine") else "")]
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
    lines.append("per chip:")
    hdr = f"{'program':<14}{'block':>6}{'batch':>6}{'cache':>7}  {'fits':<5}{'args':>11}{'temp':>11}" \
          f"{'flops':>11}{'bytes acc.':>12}{'HBM bytes':>11}{'min bytes':>11}{'roofline':>11}{'collect.':>11}"
    lines.append(hdr)
    for p in rep["programs"]:
        rl, fl = p.get("roofline_seconds"), p.get("flops")
        block, cache = p.get("block_size") or "-", p.get("cache_len") or "-"
        flops = "-" if fl is None else f"{fl / 1e12:.2f} T"
        roof = "-" if rl is None else f"{rl * 1e3:.2f} ms"
        name = f"tree{p['tree_budget']}_cycle" if p.get("tree_budget") else p["name"]
        lines.append(f"{name:<14}{block!s:>6}{p['batch']:>6}{cache!s:>7}  {('yes' if p['fits'] else 'NO'):<5}"
                     f"{_gib(p['argument_bytes']):>11}{_gib(p['temp_bytes']):>11}{flops:>11}"
                     f"{_gb(p['bytes_accessed']):>12}{_gb(p.get('hbm_bytes')):>11}{_gb(p['min_bytes']):>11}{roof:>11}"
                     f"{_gb(p.get('collective_bytes')):>11}")
        if not p["fits"]:
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
    return "\n".join(lines)


def markdown_table(reports: Sequence[dict]) -> str:
    """One markdown table of several JSON reports (reports/tpu_plan/README.md)."""
    rows = ["| model | TPU (mesh) | program | block | batch | cache | fits | args / chip | temp / chip | "
            "bytes accessed | HBM bytes | min bytes | roofline | cycle / step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rep in reports:
        model = os.path.basename(os.path.dirname(rep["target"])) if rep["target"].endswith(".json") \
            else os.path.basename(rep["target"])
        mesh = f"{rep['tpu']} (data={rep['mesh']['data']}, model={rep['mesh']['model']})"
        for p in rep["programs"]:
            rl = p.get("roofline_seconds")
            ratio = rep.get("cycle_over_step", {}).get(str(p.get("block_size"))) if p["name"] == "cycle" else None
            if p.get("tree_budget"):
                ratio = rep.get("tree_cycle_over_step", {}).get(str(p["tree_budget"]))
            fits = "yes" if p["fits"] else "**no**: " + _oom_summary(p.get("error", ""))
            name = f"tree cycle, {p['tree_budget']} nodes" if p.get("tree_budget") else p["name"]
            rows.append(f"| {model} | {mesh} | {name} | {p.get('block_size') or '-'} | {p['batch']} | "
                        f"{p.get('cache_len') or '-'} | {fits} | {_gib(p['argument_bytes'])} | {_gib(p['temp_bytes'])} | "
                        f"{_gb(p['bytes_accessed'])}{' (one chunk)' if p.get('cost_note') else ''} | {_gb(p.get('hbm_bytes'))} | {_gb(p['min_bytes'])} | "
                        f"{'-' if rl is None else f'{rl * 1e3:.1f} ms'} | {'-' if ratio is None else f'{ratio:.2f}'} |")
        lb = rep.get("largest_batch")
        if lb:
            rows.append(f"| {model} | {mesh} | largest batch (block-{lb['block_size']} cycle) | | **{lb['batch']}**"
                        f"{'' if lb['exact'] else ' (lower bound)'} | {rep['programs'][-1].get('cache_len')} | | | | | | | | |")
    return "\n".join(rows)


def _oom_summary(msg: str) -> str:
    m = re.search(r"required for (.*?) \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", msg)
    return f"{m.group(2)} of {m.group(1)} > {m.group(3)}" if m else msg[:80]


def write_json(rep: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=2)
        f.write("\n")
