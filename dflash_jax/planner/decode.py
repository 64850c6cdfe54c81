"""The planner's decode programs (prefill, target-only step, DFlash cycle, tree cycle): the runtime's programs on
abstract arguments, their physical minimum of HBM traffic, whole-model costing, `plan()` and the largest batch
that fits."""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from .abstract import abstract_params, bytes_per_chip, local_shape, with_specs
from .hlo import as_on_tpu, compile_program, hbm_needed, program_record
from .topology import (
    PlanError,
    check_layout,
    make_mesh,
    parse_mesh,
    report_header,
    resolve_tpu,
    topology_devices,
)


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    target_config: object  # TargetConfig (dtype = the run's dtype)
    drafter_config: object | None  # DrafterConfig or None
    mesh: object
    batch: int  # global batch, padded to a multiple of the data axis as generate() does
    prompt_len: int
    max_new_tokens: int
    cache_len: int | None  # None: generate()'s rule per block size


class DecodePrograms:
    """Abstract arguments + compiled figures of the decode programs for one batch / cache."""

    def __init__(self, setup: DecodeSetup):
        self.s = setup

    def models(self, Bk: int, layout: str):
        """Abstract (target, drafter or None: Bk = 1 is target-only decoding)."""
        from ..drafter import Drafter
        from ..model import Target
        s = self.s
        tc, dc = s.target_config, s.drafter_config
        target = Target(params=abstract_params("target", tc, s.mesh, layout), config=tc)
        drafter = None
        if Bk > 1:
            drafter = Drafter(params=abstract_params("drafter", dc, s.mesh, layout), config=dc)
        return target, drafter

    def shapes(self, Bk: int, batch: int | None = None, tree: int | None = None):
        from ..decode.state import prompt_and_cache_len
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

        from ..decode.programs import decode_programs, program
        from ..decode.state import state_specs, stop_width
        from ..sampling import SamplingParams
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
        pre = program(pre_fn, pre_statics, pre_donate, s.mesh, pre_specs)
        pre_args = (target, drafter, tokens, lens, rows, key, stop, budget)
        if kind == "prefill":
            return pre, pre_args
        state = with_specs(jax.eval_shape(pre, *pre_args), state_specs(drafter is not None, target), s.mesh)
        fn, statics, donate, specs = progs[kind]
        return program(fn, statics, donate, s.mesh, specs), (target, drafter, state, rows, key, stop, budget)

    def engine_args(self, kind: str, Bk: int, tree: int | None = None, refill: int | None = None):
        """(jitted program, abstract args) of the serving engine's program `kind` (planner.engine.engine_args)."""
        from .engine import engine_args
        return engine_args(self, kind, Bk, tree=tree, refill=refill)

    def recurrent_state(self, batch: int):
        """Abstract GDN state (global shapes) of a hybrid target for `batch` rows."""
        import jax
        import jax.numpy as jnp

        from ..gdn import init_state
        from ..hybrid import counts
        tc = self.s.target_config
        return jax.eval_shape(lambda: init_state(tc.gdn, counts(tc)[1], batch, jnp.dtype(tc.dtype)))

    def recurrent_state_bytes(self, batch: int) -> int:
        """Per-chip bytes of a hybrid target's recurrent state (delta-rule state + conv window) for `batch` rows."""
        from ..hybrid import cache_spec as hybrid_spec
        st = self.recurrent_state(batch)
        spec = hybrid_spec().lin
        return sum(int(math.prod(local_shape(self.s.mesh, sp, a.shape))) * a.dtype.itemsize
                   for sp, a in ((spec.rec, st.rec), (spec.conv, st.conv)))

    # ---- the physical minimum of HBM traffic (per chip) ----
    def min_bytes(self, kind: str, Bk: int, batch: int | None = None, tree: int | None = None) -> int:
        import jax.numpy as jnp

        from ..sharding import cache_spec
        s = self.s
        B, P, S = self.shapes(Bk, batch, tree)
        target, drafter = self.models(Bk, "stacked")
        tc = s.target_config
        dt = jnp.dtype(tc.dtype).itemsize
        B_loc = local_shape(s.mesh, cache_spec().lengths, (B,))[0]
        new = P if kind == "prefill" else (Bk if tree is None else tree + 1)
        filled = 0 if kind == "prefill" else min(S, s.prompt_len + s.max_new_tokens)

        def weights(params, tokens):
            total = bytes_per_chip(params)
            emb = params.get("embed")
            if emb is not None and not tc.tie_word_embeddings:  # a lookup reads only the rows it needs
                rows = min(local_shape(s.mesh, emb.sharding.spec, emb.shape)[0], tokens)
                total -= bytes_per_chip(emb) - rows * emb.shape[1] * dt
            if tc.num_experts:  # MoE: only the experts the tokens select are read
                experts = expert_bytes_per_chip(params["layers"])
                total -= experts - experts * expected_expert_fraction(tc.num_experts, tc.num_experts_per_tok, tokens)
            return int(total)

        def kv(model, L, slots, layer=None, D=None):  # K and V of `slots` positions, L layers, local rows and heads
            from ..layers import first_layer, kv_heads
            D = model.config.head_dim if D is None else D
            lp = first_layer(model.params["layers"]) if layer is None else layer
            kv_loc = local_shape(s.mesh, cache_spec().k, (L, B, kv_heads(lp, D), 1, D))
            per = (1 + 4 / D) if getattr(model.config, "kv_quant", None) else dt  # 1-byte values + a float32 scale
            return int(2 * math.prod(kv_loc) * slots * per)

        if tc.is_hybrid:  # attention layers' KV + the recurrent state read once and written once
            from ..hybrid import counts
            La, _ = counts(tc)
            att = next(lp for lp, t in zip(target.params["layers"], tc.layer_types) if t == "full")
            total = weights(target.params, B_loc * new) + kv(target, La, filled + new, att) \
                + 2 * self.recurrent_state_bytes(B)
        elif tc.gemma4 is not None:  # each kind's KV: the sliding layers read at most their window
            from ..gemma4 import KINDS, counts, dims, plan
            n = counts(tc)
            window = max(int(w) for w in tc.layer_windows)
            total = weights(target.params, B_loc * new)
            for k in KINDS:
                if n[k]:
                    lp = next(lp for lp, (kind, _, own) in zip(target.params["layers"], plan(tc)) if own and kind == k)
                    read = min(filled, window) if k == "sliding" else filled
                    total += kv(target, n[k], read + new, lp, dims(tc, k)[0])
        else:
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
    import jax

    from ..moe import EXPERT_KEYS
    leaves = jax.tree_util.tree_leaves_with_path(layers)
    return sum(bytes_per_chip(a) for path, a in leaves
               if str(getattr(path[-1], "key", "")) in EXPERT_KEYS and str(path[-1].key) not in ("router", "router_bias"))


COST_METHODS = ("layers", "full")


def layer_period(tc) -> int | None:
    """The smallest p such that target layer i is built like layer i mod p (dense / MoE MLP, sliding
    window) and p divides the depth; None when the layers follow no such pattern (or share K/V: Gemma 4's
    KV-shared last layers)."""
    L = tc.num_layers
    if getattr(tc, "gemma4", None) is not None and tc.gemma4.kv_shared_layers:
        return None
    sig = [(tc.is_sparse(i), tc.layer_windows[i] if tc.layer_windows else 0,
            tc.layer_types[i] if tc.layer_types else "") for i in range(L)]
    for p in range(1, L + 1):
        if L % p == 0 and all(sig[i] == sig[i % p] for i in range(L)):
            return p
    return None


def with_target_layers(dec: DecodePrograms, n: int) -> DecodePrograms:
    """The same decode setup on the first n target layers (the drafter taps layer 0 only, so that
    two depths differ by whole untapped layers)."""
    s = dec.s
    tc = s.target_config
    kw = {"num_layers": n}
    for name in ("sparse_layers", "layer_windows", "layer_types"):
        if getattr(tc, name):
            kw[name] = tuple(getattr(tc, name)[:n])
    dc = s.drafter_config
    if dc is not None:
        dc = dataclasses.replace(dc, num_target_layers=n, target_layer_ids=(0,) * len(dc.target_layer_ids))
    return DecodePrograms(dataclasses.replace(s, target_config=dataclasses.replace(tc, **kw), drafter_config=dc))


def unrolled_cost(dec: DecodePrograms, kind: str, Bk: int, tree: int | None = None, method: str = "full") -> dict:
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

    from ..attention import count_every_block
    # decode programs: the blockwise attention loop unrolled, so every KV block of the cache is
    # counted (the compiler counts a loop body once); prefill keeps its loops (see plan())
    s = dec.s
    fill = s.prompt_len + s.max_new_tokens  # the longest fill a decode cycle of this plan sees
    with count_every_block(fill) if kind == "cycle" else contextlib.nullcontext():
        return _unrolled_cost(dec, kind, Bk, tree, method)


def _unrolled_cost(dec: DecodePrograms, kind: str, Bk: int, tree: int | None, method: str) -> dict:
    L = dec.s.target_config.num_layers
    p = layer_period(dec.s.target_config) if method == "layers" else None
    if p is None or L <= 4 * p:
        out = compile_program(*dec.args(kind, Bk, "unrolled", tree=tree))
        out["method"] = "unrolled layers"
        return out
    c3 = compile_program(*with_target_layers(dec, 3 * p).args(kind, Bk, "unrolled", tree=tree))
    c4 = compile_program(*with_target_layers(dec, 4 * p).args(kind, Bk, "unrolled", tree=tree))
    out = {"fits": c3["fits"] and c4["fits"], "compile_seconds": c3["compile_seconds"] + c4["compile_seconds"],
           "method": f"unrolled, {3 * p} and {4 * p} target layers, extended to {L}"}
    if not out["fits"]:
        out["error"] = (c3 if not c3["fits"] else c4)["error"]
        return out
    for k in ("flops", "bytes_accessed", "hbm_bytes", "collective_bytes"):
        out[k] = c4[k] + (L // p - 4) * (c4[k] - c3[k])
    return out


# ----------------------------------------------------------------------------------------------
# Model configs
# ----------------------------------------------------------------------------------------------
def load_target_config(path: str, dtype: str = "bfloat16"):
    from ..config import TargetConfig, read_config_json
    if not os.path.exists(path):
        raise PlanError(f"target config {path} does not exist (a directory with config.json, or the file)")
    return TargetConfig.from_hf(read_config_json(path), dtype=dtype)


def make_drafter_config(target_config, drafter: str | None = None, num_layers: int = 5, block_size: int = 16,
                        mask_token_id: int | None = None):
    """The drafter's config from a z-lab config.json, else DFlash's default shape for this target."""
    from ..config import DrafterConfig, read_config_json
    from ..drafter import check_compatible, drafter_config_for
    from ..model import Target
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
@as_on_tpu
def plan(target: str, tpu: str = "v5p-8", *, drafter: str | None = None, drafter_layers: int = 5,
         block_size: int = 16, block_sizes: Sequence[int] | None = None, mesh: str | None = None, batch: int = 1,
         prompt_len: int = 1024, max_new_tokens: int = 256, cache_len: int | None = None, dtype: str = "bfloat16",
         prefill: bool = True, target_step: bool = True, largest_batch: bool = True, max_probes: int = 8,
         cost: bool = True, log=None, tree_budgets: Sequence[int] = (), cost_method: str = "full",
         moe_combine: str = "psum", quant: str | None = None, kv_quant: str | None = None,
         drafter_quant: str | None = None, engine: bool = False) -> dict:
    """Compile prefill, the target-only step and the DFlash cycle (per block size) for a TPU slice;
    with `tree_budgets`, also the tree-verification cycle (N draft nodes at the drafter's block).

    target / drafter: a config.json (or its directory); without `drafter`, a DFlash drafter of
    `drafter_layers` layers and block `block_size` for this target. block_sizes: the cycle's block
    sizes (default: the drafter's). cache_len: KV slots per row (default: generate()'s rule from
    prompt_len + max_new_tokens + block). cost: also compile each program with unrolled layers for
    whole-model flops / bytes (False: memory and fit only, faster); cost_method: see unrolled_cost
    ("full": the whole unrolled model; "layers": 3 and 4 layer periods, extended, a rough estimate). moe_combine:
    how expert-parallel MoE blocks return their outputs ("psum" or "all_to_all", see dflash_jax.moe).
    quant / kv_quant: "int8" / "fp8" target weights / KV cache (dflash_jax.quant); drafter_quant: the drafter's weights
    (its context cache stays in `dtype`). engine: also the serving engine's programs (dflash_jax.engine, memory and
    fit only): its prefill of a quarter of each data shard's slots at the full prompt length, and its decode call
    of the target-only step, of each block size and of each tree budget on every slot.
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
    tcfg = dataclasses.replace(tcfg, moe_combine=moe_combine, quant=quant, kv_quant=kv_quant)
    dcfg = make_drafter_config(tcfg, drafter, drafter_layers, block_size)
    if drafter_quant:
        from ..quant import check_mode
        check_mode(drafter_quant, "drafter_quant")
        dcfg = dataclasses.replace(dcfg, quant=drafter_quant)
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
    dec = DecodePrograms(DecodeSetup(tcfg, dcfg, m, B, prompt_len, max_new_tokens, cache_len))
    for b in (1,) + blocks:
        dec.shapes(b)  # validates the cache length for every block size before compiling anything
    gen = sl.generation
    report = report_header(sl, data, model)
    report.update(target=os.path.abspath(target), dtype=dtype, requested_batch=batch,
                  drafter={"num_layers": dcfg.num_layers, "block_size": dcfg.block_size,
                           "target_layer_ids": list(dcfg.target_layer_ids)},
                  max_new_tokens=max_new_tokens, programs=[], **{k: v for k, v in (
                      ("quant", quant), ("kv_quant", kv_quant), ("drafter_quant", drafter_quant)) if v})
    if tcfg.num_experts:
        report["moe_combine"] = moe_combine
    if tcfg.is_hybrid:
        report["recurrent_state_bytes_per_chip"] = dec.recurrent_state_bytes(B)

    def run(name, kind, Bk, tree=None):
        Bq, P, S = dec.shapes(Bk, tree=tree)
        log(f"compiling {name}" + (f" (block {Bk})" if name == "cycle" else "")
            + (f" ({tree} nodes)" if tree else "") + f", batch {Bq}, cache {S} ...")
        mem = compile_program(*dec.args(kind, Bk, "stacked", tree=tree))
        c = unrolled_cost(dec, kind, Bk, tree=tree, method=cost_method) if cost and mem["fits"] else None
        rec = program_record(name, Bk if Bk > 1 else (1 if name == "target_step" else None), Bq,
                              P, S, mem, c, dec.min_bytes(kind, Bk, tree=tree), gen)
        if tree:
            rec["tree_budget"] = int(tree)
        if name == "prefill":
            rec["block_size"] = max(blocks)
            from ..decode.state import PREFILL_CHUNK
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
    if engine:
        def run_engine(name, Bk, tree=None):
            Bq, P, S = dec.shapes(Bk, tree=tree)
            log(f"compiling {name}" + (f" (block {Bk})" if Bk > 1 else "") + (f" ({tree} nodes)" if tree else "")
                + f", batch {Bq}, cache {S} ...")
            mem = compile_program(*dec.engine_args(name, Bk, tree=tree))
            kind = "prefill" if name == "engine_prefill" else "cycle"
            rec = program_record(name, Bk, Bq, P, S, mem, None, dec.min_bytes(kind, Bk, tree=tree), gen)
            if tree:
                rec["tree_budget"] = int(tree)
            report["programs"].append(rec)
        run_engine("engine_prefill", max(blocks))
        for b in (1,) + blocks:
            run_engine("engine_decode", b)
        for n in tree_budgets:
            run_engine("engine_decode", dcfg.block_size, int(n))
    if largest_batch:
        b = max(blocks)
        report["largest_batch"] = largest_fitting_batch(dec, b, data, cycles[b], gen.hbm_bytes, max_probes, log)
    return report


def largest_fitting_batch(dec: DecodePrograms, Bk: int, step: int, first: dict, hbm: int, max_probes: int = 8,
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
        r = compile_program(*dec.args("cycle", Bk, "stacked", batch=guess))
        if r.get("compile_error"):  # not a capacity limit: the search cannot go on
            return {"program": "cycle", "block_size": Bk, "batch": lo, "exact": False, "smallest_not_fitting": hi,
                    "probes": probes, "compile_error": f"batch {guess}: {r['error']}"}
        known[guess] = hbm_needed(r)
    return {"program": "cycle", "block_size": Bk, "batch": lo, "exact": hi is not None and hi - lo <= step,
            "smallest_not_fitting": hi, "probes": probes}

