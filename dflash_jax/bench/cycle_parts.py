"""The cost of one DFlash cycle relative to one target step (python -m infer.bench_cycle): each shape's fused decode
loop, and the parts of the same cycle timed apart.

The parts are the real program's: `decode.programs.cycle` is draft_stage -> verify_stage -> accept_stage and
`tree_cycle` is draft_logits_stage + tree.build_tree -> tree_verify_stage -> tree_accept_stage; `chain_parts` and
`tree_parts` jit those same functions one by one, wrapped only so that a part can run again at the same position
(the cache's fill index and the state's counters put back, its buffers written in place as in the loop).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from .args import cache_len_for, log
from .bandwidth import best_time
from .models import bench_target_config, drafter_taps, random_prompts, tree_bytes

TOPK_CHUNK = 1024  # the two-stage builder's slice (tree.chunked_top_k), timed beside the program's builder


def keep_position(new, st):
    """The state a stage returned, at `st`'s position: fill lengths, anchor, counters and flags as in `st`, the
    buffers (caches, tokens, histories) as the stage wrote them."""
    dcache = new.dcache.rollback(st.dcache.lengths) if new.dcache is not None else None
    return new.replace(tcache=new.tcache.rollback(st.tcache.lengths), dcache=dcache, anchor=st.anchor,
                       gen_len=st.gen_len, done=st.done, cycle=st.cycle)


def chain_parts(Bk: int, sp=None):
    """`decode.programs.cycle`'s stages at block Bk, each jitted apart (greedy unless `sp`):

        draft(target, drafter, anchor, dcache) -> block [B, Bk]                       draft_stage
        verify(target, drafter, tcache, block, rows, key) -> (post, feats, tcache)   verify_stage (tcache donated,
                                                                                      returned at its length)
        accept(drafter, st, block, post, feats, stop_ids, budget) -> (n [B], st)     accept_stage (st donated,
                                                                                      returned by keep_position)"""
    import jax
    from ..decode.programs import accept_stage, draft_stage, verify_stage
    from ..sampling import SamplingParams
    sp = SamplingParams() if sp is None else sp

    @jax.jit
    def draft(target, drafter, anchor, dcache):
        return draft_stage(target, drafter, anchor, dcache, Bk=Bk)[0]

    @functools.partial(jax.jit, donate_argnums=(2,))
    def verify(target, drafter, tcache, block, rows, key):
        post, tc, feats = verify_stage(target, drafter, tcache, block, rows, key, sp=sp)
        return post, feats, tc.rollback(tcache.lengths)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def accept(drafter, st, block, post, feats, stop_ids, budget):
        # accept_stage reads the verified cache's buffers only (commit sets its length): the state's own is that cache
        new = accept_stage(drafter, st, block, post, st.tcache, feats, stop_ids, budget)
        return new.gen_len - st.gen_len, keep_position(new, st)

    return draft, verify, accept


def tree_parts(Bk: int, N: int, sp=None):
    """`decode.programs.tree_cycle`'s stages for an N-node tree at block Bk, each jitted apart:

        draft(target, drafter, anchor, dcache) -> logits [B, Bk - 1, V]               draft_logits_stage
        build(logits, anchor) -> tree                                                 tree.build_tree
        build2(logits, anchor) -> tree             the two-stage top-k builder (TOPK_CHUNK slices), for comparison
        verify(target, drafter, tcache, tree, rows, key) -> (choice, feats, tcache)  tree_verify_stage
        accept(drafter, st, tree, choice, feats, stop_ids, budget) -> (n [B], st)    tree_accept_stage"""
    import jax
    from ..decode.programs import draft_logits_stage, tree_accept_stage, tree_verify_stage
    from ..sampling import SamplingParams
    from ..tree import build_tree
    sp = SamplingParams() if sp is None else sp

    @jax.jit
    def draft(target, drafter, anchor, dcache):
        return draft_logits_stage(target, drafter, anchor, dcache, Bk=Bk)

    build = jax.jit(lambda dl, anchor: build_tree(dl, anchor, N))
    build2 = jax.jit(lambda dl, anchor: build_tree(dl, anchor, N, chunk=TOPK_CHUNK))

    @functools.partial(jax.jit, donate_argnums=(2,))
    def verify(target, drafter, tcache, tree, rows, key):
        choice, tc, feats = tree_verify_stage(target, drafter, tcache, tree, rows, key, sp=sp)
        return choice, feats, tc.rollback(tcache.lengths)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def accept(drafter, st, tree, choice, feats, stop_ids, budget):
        new = tree_accept_stage(drafter, st, tree, choice, st.tcache, feats, stop_ids, budget, Bk=Bk, N=N)
        return new.gen_len - st.gen_len, keep_position(new, st)

    return draft, build, build2, verify, accept


def prefilled(target, drafter, prompts, prompt_len: int, steps: int, Bk: int, width: int):
    """A decode state after the prefill of `prompts` (cache for `steps` + 1 new tokens and `width`-slot
    verifications, no stop tokens), for timing a cycle's parts: (state, rows, key, stop ids, budget [B])."""
    import jax
    import jax.numpy as jnp
    from ..decode.programs import prefill
    from ..sampling import SamplingParams
    batch = len(prompts)
    S = cache_len_for([prompt_len], steps + 1, width)
    budget = jnp.full((batch,), steps + 1, jnp.int32)
    rows_ids = jnp.arange(batch, dtype=jnp.int32)
    key = jax.random.PRNGKey(0)
    stop = jnp.full((batch, 1), -1, jnp.int32)
    pre = jax.jit(lambda t, d, a, b: prefill(t, d, a, b, rows_ids, key, stop, budget, S=S, Bk=Bk, sp=SamplingParams()))
    st = pre(target, drafter, jnp.asarray(np.asarray(prompts, np.int32)), jnp.full((batch,), prompt_len, jnp.int32))
    return st, rows_ids, key, stop, budget


def time_chain_parts(target, drafter, prompts, prompt_len: int, steps: int, Bk: int, repeats: int) -> dict:
    """Median ms of each of `chain_parts`' stages after a prefill of `prompts` (the fused loop's weights)."""
    from ..decode.programs import rows_layout
    st, rows_ids, key, stop, budget = prefilled(target, drafter, prompts, prompt_len, steps, Bk, Bk)
    draft, verify, accept = chain_parts(Bk)
    # the parts on the weights the fused loop multiplies by (on CPU its row layout, decode.programs.rows_layout)
    lt, ld = rows_layout(target, drafter, Bk)
    block = draft(lt, ld, st.anchor, st.dcache)
    post, feats, tc = verify(lt, ld, st.tcache, block, rows_ids, key)
    box = {"st": st.replace(tcache=tc)}

    def run_verify():
        s = box["st"]
        p, f, tc = verify(lt, ld, s.tcache, block, rows_ids, key)
        box["st"] = s.replace(tcache=tc)
        return p, f

    def run_accept():
        n, box["st"] = accept(ld, box["st"], block, post, feats, stop, budget)
        return n

    reps = max(repeats * 3, 5)
    t = {"draft_ms": best_time(lambda: draft(lt, ld, box["st"].anchor, box["st"].dcache), reps),
         "verify_ms": best_time(run_verify, reps), "accept_ms": best_time(run_accept, reps)}
    t = {k: 1e3 * v for k, v in t.items()}
    t["parts_ms"] = sum(t.values())
    return t


def time_tree_parts(target, drafter, prompts, prompt_len: int, steps: int, Bk: int, N: int, repeats: int) -> dict:
    """Median ms of each of `tree_parts`' stages after a prefill of `prompts` (the fused loop's weights)."""
    from ..decode.programs import rows_layout
    from ..decode.state import verify_width
    st, rows_ids, key, stop, budget = prefilled(target, drafter, prompts, prompt_len, steps, Bk, verify_width(Bk, N))
    draft, build, build2, verify, accept = tree_parts(Bk, N)
    lt, ld = rows_layout(target, drafter, verify_width(Bk, N))
    dl = draft(lt, ld, st.anchor, st.dcache)
    tree = build(dl, st.anchor)
    choice, feats, tc = verify(lt, ld, st.tcache, tree, rows_ids, key)
    box = {"st": st.replace(tcache=tc)}

    def run_verify():
        s = box["st"]
        c, f, tc = verify(lt, ld, s.tcache, tree, rows_ids, key)
        box["st"] = s.replace(tcache=tc)
        return c, f

    def run_accept():
        n, box["st"] = accept(ld, box["st"], tree, choice, feats, stop, budget)
        return n

    reps = max(repeats * 3, 5)
    t = {"draft_ms": best_time(lambda: draft(lt, ld, box["st"].anchor, box["st"].dcache), reps),
         "build_ms": best_time(lambda: build(dl, box["st"].anchor), reps),
         "verify_ms": best_time(run_verify, reps), "accept_ms": best_time(run_accept, reps)}
    t = {k: 1e3 * v for k, v in t.items()}
    t["parts_ms"] = sum(t.values())
    t["build_two_stage_ms"] = 1e3 * best_time(lambda: build2(dl, box["st"].anchor), reps)  # not in the sum
    return t


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
    from ..attention import default_impl
    from ..decode.api import generate
    from ..drafter import init_drafter
    from ..model import init_target

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
                           seed=1, target_layer_ids=drafter_taps(cfg.num_layers, drafter_layers), layout=layout,
                           rng="device")
    jax.block_until_ready((target.params, drafter.params))
    log(f"init: {time.perf_counter() - t0:.1f}s, target {tree_bytes(target.params) / 1e9:.3f} GB, "
        f"drafter {tree_bytes(drafter.params) / 1e9:.3f} GB")
    # the fused loop of every shape, round-robin: each shape compiles (and runs) once, then `repeats` rounds
    # time every shape once each, so a drift of the machine's speed hits all shapes alike; per shape the median
    shapes = [("target", None, None)] + [(f"B={b}", b, None) for b in blocks] + [(f"tree {n}", None, int(n)) for n in trees]
    prompts = random_prompts(batch, prompt_len, cfg.vocab_size)

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
        row = {"block": Bk, "cycle_ms": 1e3 * t_cyc, "ratio": t_cyc / t_step, "cycles": r.cycles, "tau": r.tau}
        row.update(time_chain_parts(target, drafter, prompts, prompt_len, steps, Bk, repeats))
        row["loop_overhead_ms"] = row["cycle_ms"] - row["parts_ms"]
        rows.append(row)
        log(f"  B={Bk}: cycle {row['cycle_ms']:.2f} ms = {row['ratio']:.3f} x target step; parts: draft "
            f"{row['draft_ms']:.2f} + verify {row['verify_ms']:.2f} + accept {row['accept_ms']:.2f} = "
            f"{row['parts_ms']:.2f} ms")
    Bk = max(blocks)
    for n in trees:
        lab = f"tree {int(n)}"
        row = {"block": Bk, "tree": int(n), "cycle_ms": 1e3 * med[lab], "ratio": med[lab] / t_step,
               "cycles": last[lab].cycles, "tau": last[lab].tau}
        row.update(time_tree_parts(target, drafter, prompts, prompt_len, steps, Bk, int(n), repeats))
        rows.append(row)
        log(f"  tree {n}: cycle {row['cycle_ms']:.2f} ms = {row['ratio']:.3f} x target step; parts: draft "
            f"{row['draft_ms']:.2f} + build {row['build_ms']:.2f} + verify {row['verify_ms']:.2f} + accept "
            f"{row['accept_ms']:.2f} = {row['parts_ms']:.2f} ms; the build with a two-stage top-k ({TOPK_CHUNK}-token "
            f"slices) {row['build_two_stage_ms']:.2f} ms")
    for row in rows:  # each shape's cycle / step in every round (the step of the same round)
        lab = f"tree {row['tree']}" if row.get("tree") else f"B={row['block']}"
        row["ratio_rounds"] = [c / t for c, t in zip(times[lab], times["target"])]
    return {"config": dataclasses.asdict(cfg), "target_step_ms": 1e3 * t_step, "batch": batch,
            "prompt_len": prompt_len, "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "weight_bytes": tree_bytes(target.params), "rows": rows}


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
    log("(parts: the cycle's own stages - decode.programs draft_stage, verify_stage, accept_stage - jitted apart; "
        "fused-sum = fused-loop time per cycle minus their sum; negative = the fused loop is cheaper than dispatching "
        "the parts one by one)")
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
            "cycle / step over the timed rounds, each over its own round's step; parts: tree_cycle's own stages jitted "
            "apart - the drafter's block pass + logits, the tree builder, the N + 1 rows' verification, the walk + K/V "
            "compaction + commit)")
