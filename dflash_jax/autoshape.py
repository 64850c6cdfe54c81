"""Automatic verification shape: target-only, a chain block B, or a draft tree of N nodes.

Expected committed tokens per second of a shape = tau(shape) / cycle_time(shape). Cycle times are
measured once per (pair, batch, device kind, cache size) as a cost curve relative to one target
step, and cached on disk (`$DFLASH_JAX_CACHE`, default ~/.cache/dflash_jax, file shape_costs.json).
Both are refined by what real calls show (`Evidence`, kept on disk beside them: evidence.json):
  * acceptance: one per-depth model of the chain - the chance that draft d is accepted after the
    d - 1 before it - fed by every drafted cycle (a tree cycle reports what the full-block chain would
    have committed in it, so the chain estimates stay current whichever shape runs); a chain of B
    commits 1 + its accepted drafts, at most B; a tree of N nodes what the chain to depth min(N, D) + 1
    commits times the tree's observed gain over that, measured by chain calls' shadow trees - by its own runs only
    until a chain call shadowed it: paired at the tree's own anchors, its runs read the gain low - (`shadow_trees`:
    each cycle of a chain builds the trees unverified, and the committed text says what each would have committed
    there - paired with the chain's own commits, no tree need run; trees never measured borrow the
    gain of a smaller one; one whose estimate comes within `explore` of the best is tried in looks until it ran, or
    was shadowed in, TREE_TRY_CYCLES row-cycles); a row's first EARLY_TOKENS tokens are harder to draft than the rest of its
    first LOOK_TOKENS, and those than what follows, so the three parts are modelled apart;
  * a look - the first run, a probe, a tree being tried - runs LOOK_TOKENS tokens, and the call goes on
    with the best shape for the later part (generate: lossless), whose estimates are the model's later part
    scaled by how the look's answer drafted against the model (`Evidence.for_the_rest`); target-only is chosen
    only after MIN_EVIDENCE drafted calls; with target-only chosen (or right after a probe), a whole call's estimates
    are scaled by how the last drafted calls drafted against the model (`Evidence.recent_scale`: the model lags a
    change of text, and few drafted calls come while target-only runs);
  * acceptance evidence decays per (part, depth) with a half-life of HALF_LIFE row-cycles and CALL_HALF_LIFE
    calls that observed it (a depth or part a call did not reach keeps what it showed), so the
    choice follows the text (e.g. to target-only on text the drafter does not know); with target-only chosen, the
    PROBE_EVERY-th call in a row runs the best drafted shape, and a probe that does not pay doubles
    that interval (up to PROBE_MAX calls) unless that shape is a near miss (PROBE_NEAR); when the depths
    past the best chain are little seen (its own cycles never reach them) or were verified by no call for
    DEEP_AGE calls, a deeper chain whose estimate comes within DEEP_TRY of it gets a look, and a probe from
    target-only runs that deeper chain;
  * cycle cost: the measured curve moved toward the observed time per cycle of real calls (COST_PRIOR
    observed cycles weigh as much as the curve), relative to the target step timed in the same time window
    (TIME_WINDOW: a cost is the ratio of two timings, and the machine's speed moves; windows without target
    steps leave the costs as they were) at the same cache fill (a slope per token of fill, fitted with them);
    what all drafted shapes' calls share (their drift from the curve) moves the shapes not run lately too; old
    windows fade (TIME_HALF_LIFE);
    where no target step was timed lately and drafting pays less than REF_BELOW x, a call runs target-only
    (`Choice.reference`), so that drift can be measured at all.
The policy is replayed offline, without a model, in reports/reference/auto_replay.
target-only has tau 1 and cost 1; a drafted shape is chosen over it from an expected HURDLE x. The choice and its
reason are one line (`Choice.reason`).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time as _time

import numpy as np

CHAIN_BLOCKS = (2, 4, 8, 16)
TREE_BUDGETS = (3, 7, 15, 31, 63)  # root + nodes = 4 ... 64 verified rows: whole tiles of a dot's rows (GSM8K, embedded
# pair, 2-core CPU, T=0: tree 7 2.86 target steps a cycle, 1.24x target-only, tree 8 3.08 steps, 1.19x; 24 rows cost
# less than 21; reports/reference/trees_aligned_cpu)
ENV_DIR = "DFLASH_JAX_CACHE"
COST_VERSION = 6  # part of every cost-curve key: bumped when the decode program's cost or its measurement
# changes (2: CPU row layout, 3: chain_hist, 4: 7 rounds, 5: prompts as long as the first real call's, 6: CPU
# attention defaults - dense over short caches, 128-slot blocks)


def cache_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "dflash_jax")


@dataclasses.dataclass(frozen=True)
class Shape:
    block: int  # 1 = target-only
    tree: int | None = None

    @property
    def label(self) -> str:
        if self.block == 1:
            return "target-only"
        return f"tree {self.tree}" if self.tree else f"B={self.block}"

    @property
    def width(self) -> int:
        """Cache slots one verification of this shape writes (generate.verify_width)."""
        from .decode.state import verify_width
        return verify_width(self.block, self.tree)

    @property
    def key(self) -> str:
        return "target" if self.block == 1 else (f"tree{self.tree}" if self.tree else f"B{self.block}")


def candidate_shapes(drafter_block: int, blocks=CHAIN_BLOCKS, trees=TREE_BUDGETS) -> list[Shape]:
    out = [Shape(1)] + [Shape(b) for b in blocks if 2 <= b <= drafter_block]
    return out + [Shape(drafter_block, n) for n in trees]


def pair_key(target, drafter) -> str:
    """A fingerprint of the pair: configs + a few weight values (so a retrained drafter re-measures
    nothing, costs depend only on shapes, but different checkpoints stay apart)."""
    import jax
    h = hashlib.sha1(repr((target.config, drafter.config)).encode())
    for leaf in jax.tree.leaves(drafter.params)[:2] + jax.tree.leaves(target.params)[:2]:
        head = leaf[(0,) * (leaf.ndim - 1)][:16] if leaf.ndim else leaf  # a few values: never fetch the array
        h.update(np.asarray(jax.device_get(head)).ravel().astype(np.float32).tobytes())
    return h.hexdigest()[:16]


def _device_kind() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}:{jax.device_count()}"


def _cost_file() -> str:
    return os.path.join(cache_dir(), "shape_costs.json")


def _read_costs() -> dict:
    try:
        with open(_cost_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_costs(table: dict) -> None:
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = _cost_file() + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, _cost_file())


def cost_key(target, drafter, batch: int, cache_len: int) -> str:
    """The cost-curve entry of a (pair, batch, device kind, cache size) in the disk cache."""
    return f"{pair_key(target, drafter)}|b{batch}|{_device_kind()}|S{cache_len}|v{COST_VERSION}"


def _process_count() -> int:
    import jax
    return jax.process_count()


def _from_process_0(values) -> list:
    """Process 0's values of a float list every process holds one of (multi-host agreement)."""
    from jax.experimental import multihost_utils
    return [float(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))]


def monotone(costs: dict, shapes) -> dict:
    """`costs` (shape key -> cycle cost) with each family - chains by block, trees by budget - made
    non-decreasing (running maximum): a longer chain or a larger tree never costs less (`cost_curve`)."""
    out = dict(costs)
    for fam in (sorted((s for s in shapes if s.block > 1 and not s.tree), key=lambda s: s.block),
                sorted((s for s in shapes if s.tree), key=lambda s: s.tree)):
        top = 0.0
        for s in fam:
            top = max(top, out[s.key])
            out[s.key] = top
    return out


def cost_curve(target, drafter, batch: int, cache_len: int, shapes, steps: int = 48, rounds: int = 7,
               log=None, prompt_len: int | None = None) -> dict:
    """{shape key: cycle time / target step time} for this pair, batch and cache length: read from the
    disk cache, or measured and stored. Measuring: every shape compiles once, then `rounds` rounds
    each time every shape for `steps` cycles on random prompts without stop tokens (round-robin, so
    load drifts hit all shapes alike); per shape the median round. The prompts are `prompt_len` tokens
    long - generate() passes its first call's longest prompt - or, without it, fill a quarter of the cache:
    attention cost follows the fill, and a target step gains more from a longer fill than a verify pass
    does (embedded pair, 2-core CPU, cache 1024: at 256-token prompts B=2 / B=4 / B=8 cost 1.43 / 1.96 /
    2.35 steps, at 150 tokens, GSM8K's length, 1.62-1.64 / 2.16-2.31 / 2.66-2.94, as GSM8K calls measured).
    A longer chain or a larger tree
    never costs less on any hardware, so within each family the curve is made non-decreasing
    (running maximum over block / budget) to keep timing noise from ranking them backwards."""
    from .decode.api import generate
    key = cost_key(target, drafter, batch, cache_len)
    table = _read_costs()
    have = table.get(key, {})
    missing = [s for s in shapes if s.key not in have]
    many = _process_count() > 1
    if many:  # every process must run the same measuring calls (or none): process 0's cache decides
        theirs = _from_process_0([have.get(s.key, -1.0) for s in shapes])
        if min(theirs) > 0:
            have, missing = {s.key: float(v) for s, v in zip(shapes, theirs)}, []
        else:
            missing = list(shapes)
    if missing:
        rng = np.random.default_rng(0)
        V = target.config.vocab_size
        room = cache_len - max(s.width for s in shapes)  # prompt + steps + 1 new tokens must fit
        steps = max(1, min(steps, room - 17))  # a small cache: fewer cycles, so a 16-token prompt still fits
        plen = max(1, min(int(prompt_len) if prompt_len else cache_len // 4, room - steps - 1))
        prompts = [rng.integers(0, V, size=plen).tolist() for _ in range(batch)]
        todo = [Shape(1)] + [m for m in missing if m.block > 1]

        def run(s):
            kw = dict(max_new_tokens=steps + 1, stop_token_ids=[], max_cache_len=cache_len)
            d = drafter if s.block > 1 else None
            if d is not None:
                kw.update(block_size=s.block, tree_budget=s.tree)
            r = generate(target, d, prompts, **kw)
            return r.decode_time / max(r.cycles, 1)

        # the decode loop's weight layout is chosen by a timing (generate.rows_pay -> layers.rows_faster, once per
        # process and row count): taken now, one at a time, not while the threads below compile - timed under
        # their load, one came out backwards (session 22, run F: B=4 on the [out, in] copy, 2.68 target steps a
        # cycle in the curve and 2.41-2.65 in the fixed runs beside it, where the other five runs measured 2.1-2.2)
        from .decode.programs import rows_pay
        for s in todo:
            rows_pay(target, drafter if s.block > 1 else None, s.width)
        # compile (and run once) every shape, in threads: compiling is host work that parallelises (a
        # TPU host compiles a large model's programs for minutes each; 2-core CPU, embedded pair: 59 -> 30 s
        # for 6 shapes); timings come after, one at a time. Multi-host: in order (every process must issue
        # the same programs in the same order)
        from concurrent.futures import ThreadPoolExecutor
        workers = 1 if many else max(1, min(len(todo), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run, todo))
        times = {s.key: [] for s in todo}
        for _ in range(rounds):
            for s in todo:
                times[s.key].append(run(s))
        base = float(np.median(times["target"]))
        new = {k: float(np.median(v)) / base for k, v in times.items()}
        new["target"] = 1.0
        if many:  # one curve everywhere: process 0's timings
            new = dict(zip(new, (float(v) for v in _from_process_0(list(new.values())))))
        have = monotone({**have, **new}, shapes)
        table = _read_costs()
        table[key] = have
        _write_costs(table)
        if log:
            log(f"auto shape: measured cycle costs for {len(missing)} shape(s) at batch {batch}, cache {cache_len} "
                f"-> {_cost_file()}")
    return {s.key: have[s.key] for s in shapes}


HALF_LIFE = 512  # row-cycles after which older acceptance evidence counts half (the text may change) ...
RECENT_HALF_LIFE = 2.0  # drafted calls: with target-only chosen, or in the call right after a probe, a whole call's
# estimates are the model's x how the last drafted calls drafted against it (`Evidence.recent_scale`, this half-life,
# shrunk toward 1 by RECENT_PRIOR cycles; 0: off). The model moves only with the calls that observe it, and few do while
# target-only runs (probes), so after a change of text it lags: session 22, run J, MT-Bench after the other sets - B=8
# ran whole calls at an expected 1.11x (tau 2.78) that ran at 0.6x (tau 1.6). Not while drafting: GSM8K's answers alone
# move that ratio 0.66-1.24 (5-95%), and applied there it stopped drafting that paid (replay, s22 costs, 24 seeds: GSM8K
# 0.993 -> 0.95-0.97 of the best); applied with target-only chosen: MT-Bench 0.973 -> 0.997, the other sets within 0.5%;
# and in the call after a probe as well (the probe's own rest is judged by its look, but the next call was judged by the
# lagging model again): MATH-500 / HumanEval +0.3-0.6% (48 seeds)
RECENT_PRIOR = 16.0
CALL_HALF_LIFE = 8  # ... and calls that observed it (each call is new text: a set of short answers - code after
# maths - must move the estimates within a few calls; session 9's code stayed on B=4 through 10 HumanEval prompts at
# 8). Session 13 replay (exact drafts, auto_replay): at 4, GSM8K answers' spread (a look's accepted drafts vary with
# sd 37% of their mean) pushed B=8's estimate under the hurdle for stretches of calls, 0.92-0.94 of the best; at 8
# 0.96-0.99, the other sets within 1-3% of what 4 gave
EARLY_TOKENS = 32  # a row's first generated tokens are harder to draft (GSM8K, embedded pair: chain commits 2.7
# per cycle there vs 4.7 later): acceptance is kept apart for them, for the rest of a look (up to LOOK_TOKENS) and for
# what comes after (`Evidence.blend`); GSM8K, B=8: 2.71 / 3.60 / 4.33 tokens per cycle in the three parts
NPARTS = 3  # parts of a row: [0, EARLY_TOKENS), [EARLY_TOKENS, LOOK_TOKENS), [LOOK_TOKENS, ...)
REST = 2  # the part the rest of a call after its look is in
RATIO_PRIOR = 8.0  # look cycles that weigh as much as "this answer drafts as the model expects" (`for_the_rest`)
DEPTH_PRIOR = 4.0  # pseudo-cycles at depth d that carry a prior acceptance (few cycles reach deep drafts)
DEPTH_TREND = 0.9  # that prior: this x the depth before. Acceptance given the drafts before it rises over the first
# depths (embedded pair, GSM8K: one rate fitted to B=4's tau 2.6 predicts B=8 2.9, observed 3.1-3.3) and falls
# late in the block (B=16 3.3); 0.8 (session 9) sank every deep estimate once a short chain ran (its cycles say
# nothing past its block) and auto stayed on B=4; 1.0 made B=16 look 2.7x
STALE_CALLS = 4  # drafted calls without one reaching the later part after which a whole call is judged without it
# (`Evidence.blend`; MT-Bench after GSM8K, session 13: GSM8K's later part, kept through MT-Bench's looks, chose B=8
# for whole 256-token answers at an expected 1.1x that ran at 0.58x)
MIN_EVIDENCE = 8  # drafted calls on this pair before target-only may be chosen: a few hard prompts at the start
# must not end the drafting that would have paid on average. Session 16 replay (auto_replay, 12 seeds, aligned trees):
# at 4, three hard GSM8K answers at the start (the warm-up prompt twice, then a look) sank the deep depths' counts,
# B=2 - whose probes never see them again - became the best drafted shape under the hurdle and a whole pass ran
# target-only (0.81 of the best at session 15's costs); at 8 the worst seed is 0.86-0.95 there, medians and the
# other sets within the replay's noise
COST_PRIOR = 64  # observed cycles of a shape that weigh as much as its measured cost-curve entry (session 18: 256 -> 64,
# with COST_TRY looks: a curve entry 7% too high kept tree 7 from running in run L)
TIME_WINDOW = 60.0  # seconds (wall clock): cycle times are kept per window, and a drafted cycle's cost in target
# steps is judged only from windows that timed target steps too. A cost is the ratio of two timings, and this
# CPU's speed moves ~10-20% in minutes (session 16, run I: the target step took 3.0 ms on MATH-500 and 3.7-4.2 ms on
# the sets around it); B=8's MATH-500 cycles, set against steps timed minutes before on GSM8K, came out at 2.25
# target steps where the same passes measured 2.53-2.85, and auto drafted every call at 0.88x
TIME_HALF_LIFE = 600.0  # seconds after which an observed cycle time counts half (besides HALF_LIFE's cycles)
FILL_BUCKET = 128  # cache tokens: cycle times are kept apart per this much fill (`_add_time`)
FILL_UNIT = 256.0  # cache tokens: the unit of `costs`' fill slope ...
FILL_PRIOR = 4.0  # ... whose prior (0) weighs as much as this many cycles FILL_UNIT tokens from the mean fill (weak:
# the slope is learnt from calls at different fills; embedded pair, 2-core CPU: a target step 1.31 ms on MATH-500's
# prompts, 1.54 on MBPP's longer ones)
DRIFT_PRIOR = 16  # drafted cycles that weigh as much as "real calls cost what the curve says" (`Evidence.costs`)
SWITCH_MARGIN = 1.03  # a drafted shape replaces the one that ran last only when expected this much faster (estimates
# of near-tied shapes - B=8 1.33x, B=4 1.28x - flipped call by call, and each first run of a program costs ~0.2 s on
# CPU)
DEEP_TRY = 0.9  # a deeper chain runs a call when the depths past the best chain are little seen lately and its
# estimate comes within this of the best (the per-depth prior past a short chain undersold B=8 on GSM8K: auto ran
# B=4, 1.17x fixed, where B=8 gave 1.24x)
DEEP_AGE = 8  # ... or when no drafted call verified the depth past it for this many calls (its counts are kept, so
# they may be a few early answers' - session 13, GSM8K: B=4 probes for 150 calls, B=8 never looked at again)
REF_STEPS = 64  # target-only steps (decayed) timed in a context below which the drafted shapes' cost relative to a
# step is unmeasured there (the curve's own error: +-10-20% between runs on this CPU; without target-only calls the
# drift fit cannot see it) ...
REF_BELOW = 1.5  # ... which matters while the best drafted shape is expected below this: a call then runs
# target-only, whole (`Choice.reference`), timing steps over the positions drafted calls run
TREE_TRY_CYCLES = 64  # a tree whose estimate comes close is tried (a look) until it has run this many row-cycles: one
# 64-token look (~18 cycles on GSM8K) measured tree 7 at 1.02x the chain where it commits 1.15x (session 17, run J: auto
# stayed on B=8 at 0.91 of tree 7). Replay (24 seeds, s15): GSM8K 0.947 -> 0.968 of the best, the other sets within 1%
COST_TRY = 0.93  # a drafted shape whose estimate comes within this of the best and whose cycles were timed in fewer than
COST_CYCLES = 64  # ... row-cycles lately (decayed) runs a look, so that its cost is measured (`choose`)
SHADOW_EVERY = 4  # a chain call reports its shadow trees' commits (`shadow_trees`) in every this-th drafted call (and
# in all while a tree's evidence is short of TREE_TRY_CYCLES)
SHADOW_COST = 2.0  # ... for the trees whose curve cost is at most this x the chain's
HURDLE = 1.05  # a drafted shape must be expected this much faster than target-only (estimates err by ~5-10%)
PROBE_EVERY = 4  # with target-only chosen, the (PROBE_EVERY)-th call in a row looks at the best drafted shape ...
PROBE_MAX = 32  # ... and each look that does not pay doubles that interval, up to this many calls, unless the
PROBE_NEAR = 1.0  # best drafted shape is expected at this x target-only or more (then every PROBE_EVERY-th call):
# run O (session 20), MBPP after HumanEval - HumanEval's probes (B=4 0.98x there) had backed the interval off to 32
# calls, so MBPP (B=4 1.06x) ran target-only on HumanEval's estimate (0.99-1.03x) for 31 calls
LOOK_TOKENS = 64  # a look (a probe, a first run, a tree being tried) runs its shape for this many new tokens (past
# EARLY_TOKENS: it sees both parts), then the call goes on with the best shape by the updated evidence (generate:
# losslessly, from the tokens so far)


def _now() -> float:
    """Wall-clock seconds for the cycle times' decay (a replay sets its own clock here)."""
    return _time.time()


def _parts(row, offset: int = 0) -> list[int]:
    """The part of each cycle of a row that committed `row` tokens per cycle: 0 while the cycle starts in
    the row's first EARLY_TOKENS generated tokens, 1 up to LOOK_TOKENS, then 2 (`offset` tokens generated
    before; the first generated token comes from the prefill)."""
    pos, out = offset + 1, []
    for n in row:
        out.append(int(pos >= EARLY_TOKENS) + int(pos >= max(EARLY_TOKENS, LOOK_TOKENS)))
        pos += int(n)
    return out


def mean_fill(prompt_lens, acceptance_lengths, offset: int = 0) -> float | None:
    """The mean number of tokens in the cache at the start of a call's cycles, over rows and cycles (`Evidence.costs`
    prices a cycle at its fill): row i's prompt, the `offset` tokens generated before this call (a continuation)
    and what its cycles before committed. None without cycles."""
    tot = n = 0.0
    for p, row in zip(prompt_lens, acceptance_lengths):
        row = np.asarray(row, np.float64)
        if row.size:
            tot += row.size * (p + offset) + float(np.sum(np.cumsum(row) - row))
            n += row.size
    return tot / n if n else None


def _chain_given(c: int, cap: int, p) -> float:
    """What the chain to depth cap - 1 commits in a cycle whose full-block chain committed c (negative -n: at least n,
    censored): min(c, cap), or given only the bound, its expectation under the per-depth acceptance p (p[d - 1]: draft
    d accepted after the drafts before it): n + sum over k = n .. cap - 1 of P(drafts n .. k accepted)."""
    if c > 0 or -c >= cap:
        return float(min(abs(c), cap))
    n = max(-c, 1)
    out, surv = float(n), 1.0
    for k in range(n, cap):
        surv *= p[k - 1]
        out += surv
    return out


def _shrunk_ratio(obs: float, exp: float, n: float, prior: float) -> float | None:
    """obs / exp shrunk toward 1 by `prior` cycles at the mean expectation per cycle, in [0.25, 2]; None without
    an expectation (`for_the_rest`, `Evidence.recent_scale`)."""
    if n <= 0 or exp <= 0:
        return None
    per = exp / n
    return float(np.clip((obs + prior * per) / (exp + prior * per), 0.25, 2.0))


def _near(part: int) -> list[int]:
    """The other parts, nearest first (ties: the later part): where a part's estimates lean when it saw little."""
    return sorted((q for q in range(NPARTS) if q != part), key=lambda q: (abs(q - part), -q))


@dataclasses.dataclass
class Evidence:
    """What has been observed on one pair: acceptance (decayed with a half-life of HALF_LIFE row-cycles,
    so the estimates follow the text: code after maths, chat after code) and cycle times.

    Acceptance is one model for every shape: per draft depth d = 1 .. D, the chance that the chain's
    d-th draft is accepted given the d - 1 before it were (`risk[d]` cycles that verified draft d,
    `miss[d]` that rejected it; a censored cycle - a shorter block, or a tree whose greedy chain ended -
    counts for the depths it saw). Every drafted cycle feeds it, chains and trees alike (a tree cycle
    reports what the full-block chain would have committed: GenerationResult.chain_lengths), so the
    chain estimates of every block stay current whichever shape ran. A tree's acceptance is the chain's
    to its depth times its gain over that chain (`trees`: paired cycle by cycle with the chain, by chain calls' shadow
    trees, or by the tree's own runs while no chain call has shadowed it). Cycles in a
    row's first EARLY_TOKENS tokens, the rest of the first LOOK_TOKENS and later ones are kept apart (part 0 / 1 /
    2 of risk and miss): a look sees only the first two, the rest of its call is in the third. The counts of a
    (part, depth) decay only with calls whose cycles verified that draft there, so what the third part and the
    deep drafts showed is kept through calls that only look or run a short chain (GSM8K: with every part and
    depth decaying per call, the deep drafts' evidence sank to the prior while B=8 ran, B=16's estimate rose above
    it every ~30 calls and ran at 1.09x for a few calls each time).
    `time`: per shape, (batch, cache) context, TIME_WINDOW window and FILL_BUCKET band of cache fill, the decayed
    seconds, cycles and mean fill of real calls, which refine the measured cost curve (`costs`)."""
    full_block: int
    risk: list = dataclasses.field(default_factory=list)  # risk[part][d]: cycles that verified draft d (d >= 1)
    miss: list = dataclasses.field(default_factory=list)  # miss[part][d]: ... and rejected it
    lengths: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # decayed [sum of row lengths, rows]
    trees: dict = dataclasses.field(default_factory=dict)  # tree key -> [committed, model full-chain tau] sums
    shadowed: list = dataclasses.field(default_factory=list)  # tree keys a chain call has shadowed: their gain is
    # measured by shadows only from then on (`add`)
    tree_cycles: dict = dataclasses.field(default_factory=dict)  # tree key -> its row-cycles ever run (not decayed)
    scale: float = 1.0  # accepted drafts x this in every estimate: a look's answer against the model (`for_the_rest`);
    # `choose` with target-only chosen (or right after a probe): the last drafted calls' (`recent_scale`)
    recent: list = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])  # decayed per drafted call
    # (RECENT_HALF_LIFE): [accepted drafts, the model's expectation for them, cycles] of the last drafted calls
    depth_age: list = dataclasses.field(default_factory=list)  # per draft depth: drafted calls since one verified it
    rest_age: int = 0  # drafted calls since one reached the later part (REST): past STALE_CALLS, `blend` reads part 1 there
    time: dict = dataclasses.field(default_factory=dict)  # "shape key|context|window|f<fill band>" -> [seconds,
    # cycles, fill x cycles, cycles whose fill is known] (`_add_time`)
    clock: float = 0.0  # wall-clock time (`_now`) the `time` entries are weighed at (TIME_HALF_LIFE)
    probed: bool = False  # the last drafted call was a probe (target-only calls ran before it)
    idle: int = 0  # calls in a row that ran target-only
    drafted: int = 0  # drafted calls seen
    probe_every: int = PROBE_EVERY
    last: str | None = None  # the shape key of the last call (or continuation)

    def __post_init__(self):
        if not self.risk:  # part 0: cycles starting in a row's first EARLY_TOKENS generated tokens, 1: up to
            # LOOK_TOKENS, 2: later
            self.risk = [[0.0] * self.full_block for _ in range(NPARTS)]
            self.miss = [[0.0] * self.full_block for _ in range(NPARTS)]
        if not self.depth_age:
            self.depth_age = [0] * self.full_block

    def add(self, shape: Shape, acceptance_lengths, chain_lengths=None, seconds: float | None = None,
            cycles: int | None = None, context: str = "", offset: int = 0, reference: bool = False,
            shadows: dict | None = None, fill: float | None = None) -> None:
        """One call's outcome: tokens committed per cycle per row, what the full-block chain would have
        committed per cycle (negative -n: at least n; None: taken from a chain's own commits), and the
        decode seconds over `cycles` loop iterations (cost evidence for `context`). `offset`: tokens each
        row had generated before this call (a continuation). `reference`: target-only steps run to time them
        (`Choice.reference`): the choice was drafted, so they count as cost evidence only. `shadows` (a chain's call):
        {tree budget N: per row and cycle, what a tree of N nodes would have committed there (0: unknown)}
        (GenerationResult.shadow_lengths): each tree's gain over the chain to its depth, from this chain's own commits
        in the same cycles, as if the tree had run them. `fill`: the mean cache fill (tokens) at the call's cycles
        (`mean_fill`): a step or a cycle costs more over a fuller cache, so `costs` compares timings at their fills."""
        lens = [int(x) for row in acceptance_lengths for x in row]
        if seconds is not None and cycles:
            self._add_time(shape.key, context, seconds, cycles, fill)
        if reference:
            return
        self.last = shape.key
        if shape.block == 1:
            self.idle += 1
            return
        # a drafted call right after target-only calls was a probe: the next one waits twice as long
        # unless the choice stays drafted (then the interval is back to PROBE_EVERY)
        self.probe_every = min(2 * self.probe_every, PROBE_MAX) if self.idle else PROBE_EVERY
        if offset == 0:  # a continuation is the same call
            self.drafted += 1
            self.probed = bool(self.idle)
        self.idle = 0
        if not lens:
            return
        self._add_recent(shape, acceptance_lengths, offset)
        if chain_lengths is None and shape.tree:  # nothing said of the chain: the tree's gain only
            chain_lengths = [[] for _ in acceptance_lengths]
        elif chain_lengths is None:  # a chain's commits: n of block B (all B: the full block would say more)
            chain_lengths = [[-n if (n >= shape.block and shape.block < self.full_block) else n for n in row]
                             for row in acceptance_lengths]
        # a tree's gain fades with the calls that measured it (a run of it, or its shadow in a chain's call): a gain
        # over the chain holds across texts better than acceptance itself, and shadows come in some calls only
        keep = 0.5 ** (len(lens) / HALF_LIFE + 1 / CALL_HALF_LIFE)
        if shape.tree:
            measured = set() if shape.key in self.shadowed else {shape.key}
        else:
            measured = {Shape(self.full_block, n).key for n in shadows or ()}
        for k in measured:
            if k in self.trees:
                self.trees[k][0] *= keep
                self.trees[k][1] *= keep
        D = self.full_block - 1
        # this call's counts, then each (part, depth) decays by what it observed: HALF_LIFE cycles that verified
        # that draft, or CALL_HALF_LIFE calls with any, halve the old counts there. A depth this call did not reach
        # (its chain stopped short of it, or its part was not reached: a look never sees past LOOK_TOKENS) keeps
        # what earlier calls saw of it, instead of sinking to the prior
        risk = [[0.0] * self.full_block for _ in range(NPARTS)]
        miss = [[0.0] * self.full_block for _ in range(NPARTS)]
        chain_lengths = [[int(x) for x in row if x] for row in chain_lengths]  # per row, the active cycles'
        for acc_row, chain_row in zip(acceptance_lengths, chain_lengths):
            for part, x in zip(_parts(acc_row, offset), chain_row):
                k = abs(x) - 1  # accepted drafts
                for d in range(1, min(k, D) + 1):
                    risk[part][d] += 1.0
                if x > 0 and k < D:
                    risk[part][k + 1] += 1.0
                    miss[part][k + 1] += 1.0
        if risk[REST][1]:
            self.rest_age = 0
        elif offset == 0:
            self.rest_age += 1
        for d in range(1, self.full_block):
            if any(r[d] for r in risk):
                self.depth_age[d] = 0
            elif offset == 0:
                self.depth_age[d] += 1
        for part in range(NPARTS):
            for d in range(1, self.full_block):
                n = risk[part][d]
                if n:
                    f = 0.5 ** (n / HALF_LIFE + 1 / CALL_HALF_LIFE)
                    self.risk[part][d] = self.risk[part][d] * f + n
                    self.miss[part][d] = self.miss[part][d] * f + miss[part][d]
        if shape.tree:
            # its gain: committed tokens over what the chain to its depth commits in the same cycles - paired cycle
            # by cycle, so an answer's own difficulty cancels: the chain's commit where the cycle tells it, and
            # where it tells only a lower bound (the tree's greedy chain ended first) the model's expectation given
            # that bound (the model, now updated with these cycles). Against the model's expectation alone, the
            # gain of tree 7 on GSM8K ended the sweeps at 0.93-1.11 where its runs commit 1.15x what B=8's do
            cap = min(shape.tree, D) + 1
            t = self.trees.setdefault(shape.key, [0.0, 0.0])
            self.tree_cycles[shape.key] = self.tree_cycles.get(shape.key, 0) + len(lens)
            # (only while no chain call has shadowed it: paired at its own anchors, the gain reads low - below)
            probs = None if shape.key in self.shadowed else [self.accept_probs(part) for part in range(NPARTS)]
            for acc_row, chain_row in zip(acceptance_lengths, chain_lengths) if probs and None not in probs else ():
                for i, (part, x) in enumerate(zip(_parts(acc_row, offset), acc_row)):
                    t[0] += float(x)
                    c = chain_row[i] if i < len(chain_row) else -1  # no chain length told: "at least 1"
                    t[1] += _chain_given(c, cap, probs[part])
        for n, rows in (shadows or {}).items() if not shape.tree else ():
            # what the tree would have committed at this chain's anchors against what the chain to its depth
            # committed there (this chain's own commits, cut at that depth: known, as the shadow's budgets are
            # shallower than the block or the block is the full one): the gain a run of the tree measures, paired
            # cycle by cycle - an answer's own difficulty cancels (against the model's expectation instead, the
            # gain swung 0.8-1.3 with the answers, replay of GSM8K)
            key, cap = Shape(self.full_block, n).key, min(n, D) + 1
            if key not in self.shadowed:
                # from its first shadow on, a tree's gain is the shadows' alone (its runs' sums so far dropped): a run
                # pairs the tree with the chain at the tree's own anchors, and there the chain's commit is often known
                # only as a bound - the tree's greedy chain ended, and it ends where the drafter is unsure, so the
                # chain commits less past it than the model expects of a chain that got that far. Replay (exact
                # drafts, GSM8K, 4 seeds): tree 7's runs paired at 1.023, its shadows at 1.120, where tree 7 commits
                # 1.148x what B=8 does; auto ran B=8 at 0.963 of tree 7 (48 seeds; 0.989 with shadows only)
                self.trees[key] = [0.0, 0.0]
                self.shadowed.append(key)
            t = self.trees.setdefault(key, [0.0, 0.0])
            for chain_row, row in zip(chain_lengths, rows):
                for c, x in zip(chain_row, row):
                    if x > 0 and (c > 0 or -c >= cap):
                        t[0] += float(x)
                        t[1] += float(min(abs(c), cap))
                        self.tree_cycles[key] = self.tree_cycles.get(key, 0) + 1

    def _add_recent(self, shape: Shape, acceptance_lengths, offset: int) -> None:
        """A drafted call's accepted drafts against what the model (unscaled, before this call) expected of `shape` in
        the same cycles, into `recent` (each row's last cycle left out: its stop token or budget cuts it)."""
        seen = dataclasses.replace(self, scale=1.0)._against_model(shape, acceptance_lengths, offset)
        if seen is None:
            return
        obs, exp, n = seen
        if offset:  # a call's rest after its look: the same call
            keep = 1.0
        else:
            keep = 0.5 ** (1 / RECENT_HALF_LIFE) if RECENT_HALF_LIFE > 0 else 0.0
        self.recent = [self.recent[0] * keep + obs, self.recent[1] * keep + exp, self.recent[2] * keep + n]

    def recent_scale(self) -> float:
        """The last drafted calls' accepted drafts over the model's expectation (`recent`), shrunk toward 1 by
        RECENT_PRIOR cycles, in [0.25, 2]."""
        ratio = _shrunk_ratio(*self.recent, RECENT_PRIOR)
        return 1.0 if ratio is None else ratio

    def _against_model(self, shape: Shape, acceptance_lengths, offset: int = 0) -> tuple | None:
        """(accepted drafts, what the model expected of `shape` in the same cycles, cycles) of a call's rows, each row's
        last cycle left out (its stop token or budget cuts it); None when the model has nothing to go on."""
        expect = [self.tau(shape, part) for part in range(NPARTS)]
        if None in expect:
            return None
        obs = exp = 0.0
        n = 0
        for row in acceptance_lengths:
            row = [int(x) for x in row]
            for part, x in list(zip(_parts(row, offset), row))[:-1]:
                obs += x - 1
                exp += expect[part] - 1
                n += 1
        return obs, exp, n

    def for_the_rest(self, shape: Shape, acceptance_lengths, chain_lengths=None, shadows=None) -> "Evidence":
        """The evidence to choose the rest of a call with (part REST), after its look (`shape`'s cycles, not yet
        added to self): self with the look added, and `scale` = this answer's accepted drafts over what the model
        expected of `shape` in the same cycles (shrunk toward 1 by RATIO_PRIOR cycles, in [0.25, 2]). One answer is
        the best guide to its rest - after GSM8K, a probe's 64 tokens of an MT-Bench answer drafted badly, but
        the late-part evidence of GSM8K chose B=8 for its remaining ~190 tokens at 0.7x - while the look's own
        tokens (its first 64) draft worse than the rest of the same answers (GSM8K, B=8: 3.6 tokens per cycle in
        tokens 32-64, 4.3 after), so the look scales the model's later part instead of standing in for it."""
        seen = self._against_model(shape, acceptance_lengths)
        ratio = None if seen is None else _shrunk_ratio(*seen, RATIO_PRIOR)
        out = copy.deepcopy(self)
        out.add(shape, acceptance_lengths, chain_lengths, shadows=shadows)
        if ratio is not None:
            out.scale = ratio
        return out

    def add_lengths(self, lengths) -> None:
        """Tokens each row of a finished call generated (the expected length weighs early and late parts)."""
        keep = 0.5 ** (len(lengths) / CALL_HALF_LIFE)
        self.lengths = [self.lengths[0] * keep + float(sum(lengths)), self.lengths[1] * keep + len(lengths)]

    def _add_time(self, key: str, context: str, seconds: float, cycles: int, fill: float | None = None) -> None:
        now = _now()
        keep = 0.5 ** (cycles / (4 * HALF_LIFE)) * self._age(now)  # costs drift with load and time
        for k in list(self.time):
            v = self.time[k]
            for i in range(len(v)):
                v[i] *= keep
            if v[1] < 1e-2:
                del self.time[k]
        self.clock = now
        # [seconds, cycles, fill x cycles, cycles whose fill is known], apart per FILL_BUCKET tokens of fill (calls at
        # different fills in one window tell how fill costs: `costs`)
        band = "-" if fill is None else str(int(fill // FILL_BUCKET))
        t = self.time.setdefault(f"{key}|{context}|{int(now // TIME_WINDOW)}|f{band}", [0.0, 0.0, 0.0, 0.0])
        t[0] += float(seconds)
        t[1] += float(cycles)
        if fill is not None:
            t[2] += float(fill) * cycles
            t[3] += float(cycles)

    def _age(self, now: float) -> float:
        """The weight left to the `time` entries at `now` (they are weighed at `clock`)."""
        return 0.5 ** (max(0.0, now - self.clock) / TIME_HALF_LIFE) if self.clock else 1.0

    def _times(self, context: str) -> list:
        """[(shape key, window, log seconds per cycle, cycles weighed now, mean cache fill or None)] of the calls
        timed in `context`."""
        age = self._age(_now())
        out = []
        for k, v in self.time.items():
            sec, n = v[0], v[1]
            shape, rest = k.split("|", 1)
            ctx, win, _ = rest.rsplit("|", 2)
            if ctx == context and sec > 0 and n * age > 1e-3:
                fill = v[2] / v[3] if v[3] > 1e-6 else None
                out.append((shape, win, float(np.log(sec / n)), n * age, fill))
        return out

    def with_times(self, other: "Evidence") -> "Evidence":
        """self, timed by other's cycle times (shared: a call's look and rest record into one table)."""
        self.time, self.clock = other.time, other.clock
        return self

    def accept_probs(self, part: int = 1) -> list[float] | None:
        """p[d - 1] = chance that draft d is accepted given the drafts before it were (d = 1 .. D), in
        `part` (0: a row's first EARLY_TOKENS tokens, 1: up to LOOK_TOKENS, 2: later); a part never observed
        takes the nearest observed one's."""
        if self.risk[part][1] <= 0:
            part = next((q for q in _near(part) if self.risk[q][1] > 0), part)
        risk, miss = self.risk[part], self.miss[part]
        if risk[1] <= 0:
            return None
        p = []
        for d in range(1, self.full_block):
            # a depth seen in few cycles leans on the nearest other part's estimate there that saw it in
            # DEPTH_PRIOR cycles or more, else on the depth before (a short block's fully accepted cycles say
            # nothing of the depths past it, and the evidence of the last deep runs decays away)
            other = next((q for q in _near(part) if self.risk[q][d] > 0 and self.risk[q][d] >= DEPTH_PRIOR), None)
            if d == 1:
                prior, w = 0.0, 0.0
            elif other is not None:
                prior, w = (self.risk[other][d] - self.miss[other][d]) / self.risk[other][d], DEPTH_PRIOR
            else:
                prior, w = DEPTH_TREND * p[-1], DEPTH_PRIOR
            p.append((risk[d] - miss[d] + w * prior) / (risk[d] + w) if risk[d] + w > 0 else prior)
        return p

    def chain_tau(self, block: int, part: int | None = None) -> float | None:
        """Expected tokens committed per cycle by the chain of `block` (1 + accepted drafts x `scale`, at most
        block) in `part` (0 / 1 / 2), or (None) over a whole row of the expected length (`blend`)."""
        if part is None:
            return self.blend(lambda q: self.chain_tau(block, q))
        acc = self._accepted(block, part)
        if acc is None:
            return None
        return min(1.0 + self.scale * acc, float(block))

    def _accepted(self, block: int, part: int) -> float | None:
        """Expected accepted drafts per cycle of the chain of `block` in `part`, as the counts say."""
        p = self.accept_probs(part)
        if p is None:
            return None
        surv, acc = 1.0, 0.0
        for d in range(1, block):
            surv *= p[d - 1]
            acc += surv
        return acc

    def blend(self, tau_of) -> float | None:
        """Tokens per cycle over a whole row: each part's tokens ([0, EARLY_TOKENS), then up to LOOK_TOKENS,
        then the rest) at tau_of(part), for the observed mean row length (4 x EARLY_TOKENS before any)."""
        # the later part's counts are kept until a call reaches it again; when none did for STALE_CALLS drafted calls
        # (only looks, or short answers, since) they may be another text's (GSM8K's, while MT-Bench is probed with
        # looks), so a whole call is judged on the part before it (the rest of a look is judged on the later part,
        # scaled by its own answer: `for_the_rest`)
        taus = [tau_of(q) for q in range(NPARTS - 1)] + [tau_of(REST if self.rest_age <= STALE_CALLS else REST - 1)]
        if None in taus:
            return None
        n = self.lengths[0] / self.lengths[1] if self.lengths[1] > 0 else 4.0 * EARLY_TOKENS
        if n <= 0:
            return taus[-1]
        edges = [0.0, min(float(EARLY_TOKENS), n), min(float(max(EARLY_TOKENS, LOOK_TOKENS)), n), n]
        return n / sum((edges[q + 1] - edges[q]) / taus[q] for q in range(NPARTS))

    def tried(self, shape: Shape) -> bool:
        """Whether a tree has run TREE_TRY_CYCLES row-cycles (its gain is then judged on what it showed)."""
        return self.tree_cycles.get(shape.key, 0) >= TREE_TRY_CYCLES

    def tree_gain(self, shape: Shape) -> float | None:
        """Observed committed tokens of this tree per token the chain to its depth (min(N, D) + 1 tokens at
        most) commits by the model in the same cycles (each call's cycles against the model updated with
        them); for a tree never run, the gain of the largest smaller tree that ran (a larger tree never
        holds less)."""
        own = self.trees.get(shape.key)
        if own and own[1] > 0:
            return own[0] / own[1]
        smaller = [(int(k[4:]), v) for k, v in self.trees.items() if int(k[4:]) < shape.tree and v[1] > 0]
        if smaller:
            _, v = max(smaller)
            return v[0] / v[1]
        return None

    def tau(self, shape: Shape, part: int | None = None) -> float | None:
        """Estimated tokens committed per cycle (None: nothing to go on) in `part` (0: a row's first
        EARLY_TOKENS tokens, 1: up to LOOK_TOKENS, 2: later, None: a whole row). A chain of B: from the per-depth
        model. A tree of N nodes: the chain to depth min(N, D) + 1 (the tree's greedy chain plus the target's bonus
        token) times the tree's observed gain over that chain (at least 1)."""
        if shape.block == 1:
            return 1.0
        if part is None:
            return self.blend(lambda q: self.tau(shape, q))
        if not shape.tree:
            return self.chain_tau(shape.block, part)
        floor = self.chain_tau(min(shape.tree, self.full_block - 1) + 1, part)
        if floor is None:
            return None
        g = self.tree_gain(shape)
        return floor if g is None else floor * max(1.0, g)

    def costs(self, curve: dict, context: str = "") -> dict:
        """Cycle times in target steps for every shape of `curve`: the measured curve, moved toward what
        real calls in `context` took. In logs, a call of shape k in time window w (TIME_WINDOW) at mean cache fill f
        observes y_kw = L_w + beta (f - f0) + log curve_k + drift + e_k per cycle: L_w the step time then (the
        machine's speed moves, so only timings of one window compare), beta how much a fuller cache costs (one slope
        for steps and cycles: attention reads the whole fill; f0 the observations' mean fill; a call without a fill
        sits at f0) - a target step timed on a long prompt must not price the cycles of short ones (session 22: one
        HumanEval target-only call at 1.65 ms a step, the B=4 calls around it at 2.97 ms a cycle, and B=4 was fitted
        at 1.87 target steps where every set ran it at 2.06-2.20), drift what every drafted shape shares (real text,
        lengths and cache fills differ from the curve's random prompts: session 10's passes ran B=4 / B=8 / tree 16
        at +3-10 / +8-13 / +4-9% of the curve, so a shape never run since - B=4 after GSM8K ran B=8 - should move
        with the others), e_k the shape's own deviation. Fitted by weighted least squares: every cycle counts once,
        drift has a prior of 0 worth DRIFT_PRIOR cycles, each e_k one of 0 worth COST_PRIOR cycles, beta one of 0
        worth FILL_PRIOR cycles at FILL_UNIT tokens from f0. A window without target-only steps says nothing of drift
        and e_k (its L_w takes it up) beyond how its drafted shapes compare; with none that timed steps, every
        drafted cost is the curve's. Target-only's cost is 1."""
        c = {"target": 1.0, **curve}
        obs = [o for o in self._times(context) if o[0] in c]
        wins = sorted({w for _, w, _, _, _ in obs})
        keys = sorted({k for k, _, _, _, _ in obs if k != "target"})
        if not keys:
            return c
        known = [(f, n) for _, _, _, n, f in obs if f is not None]
        f0 = sum(f * n for f, n in known) / sum(n for _, n in known) if known else 0.0
        nw = len(wins)
        wi = {w: i for i, w in enumerate(wins)}
        beta, drift_col = nw, nw + 1
        col = {k: nw + 2 + i for i, k in enumerate(keys)}  # unknowns: L_w ..., beta, drift, e_k ...
        width = nw + 2 + len(keys)
        A, y = [], []
        for k, w, ly, n, f in obs:
            row = np.zeros(width)
            row[wi[w]] = 1.0
            row[beta] = 0.0 if f is None else (f - f0) / FILL_UNIT
            if k != "target":
                row[drift_col] = row[col[k]] = 1.0
                ly = ly - np.log(c[k])
            A.append(np.sqrt(n) * row)
            y.append(np.sqrt(n) * ly)
        for j, wt in [(beta, FILL_PRIOR), (drift_col, DRIFT_PRIOR)] + [(col[k], COST_PRIOR) for k in keys]:
            row = np.zeros(width)
            row[j] = np.sqrt(wt)
            A.append(row)
            y.append(0.0)
        sol = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)[0]
        drift = float(sol[drift_col])
        for k in curve:
            if k != "target":
                c[k] = float(curve[k] * np.exp(drift + (sol[col[k]] if k in col else 0.0)))
        return c

    def target_steps(self, context: str = "") -> float:
        """Target-only steps timed in `context` (decayed)."""
        return self.timed(context).get("target", 0.0)

    def timed(self, context: str = "") -> dict:
        """{shape key: its cycles timed in `context` (decayed: HALF_LIFE, TIME_HALF_LIFE)}."""
        out: dict = {}
        for k, _, _, n, _ in self._times(context):
            out[k] = out.get(k, 0.0) + n
        return out

    def cost(self, shape: Shape, curve: dict, context: str = "") -> float:
        """One shape's cycle time in target steps (`costs`)."""
        return 1.0 if shape.block == 1 else self.costs(curve, context)[shape.key]


@dataclasses.dataclass
class Choice:
    shape: Shape
    reason: str
    look: bool = False  # run for evidence (LOOK_TOKENS), not because it is the best estimate
    reference: bool = False  # a target-only call run to time target steps (REF_STEPS), not as the best estimate


def choose(shapes, costs: dict, ev: Evidence, explore: float = 0.8, context: str = "", look: bool = True,
           part: int | None = None) -> Choice:
    """The shape of highest expected committed tokens per unit time (target-only included). `costs`:
    the measured cost curve (refined by ev's observed times for `context`). look=False: the best estimate
    only (no probe, no first run of a tree). part: the estimates for a whole row (None) or, for the rest of
    a call after its look, for that part (REST)."""
    full = Shape(ev.full_block)
    if part is None and (ev.idle > 0 or ev.probed) and RECENT_HALF_LIFE > 0:
        # target-only ran last, or a probe after it: the text may have changed since the model's calls
        ev = dataclasses.replace(ev, scale=ev.scale * ev.recent_scale())  # (RECENT_HALF_LIFE)
    if ev.chain_tau(ev.full_block) is None:
        return Choice(full, f"auto shape: {full.label} (no acceptance observed yet on this pair: the full block "
                            f"shows the acceptance of every depth)", look=True)
    fitted = ev.costs(costs, context)
    cost = {s: 1.0 if s.block == 1 else fitted[s.key] for s in shapes}
    rate = {}
    for s in shapes:
        t = ev.tau(s, part)
        if t is not None:
            rate[s] = t / cost[s]
    best = max(rate, key=lambda s: rate[s] if s.block > 1 else HURDLE)
    last = next((s for s in rate if s.key == ev.last and s.block > 1), None)
    if last is not None and best.block > 1 and rate[last] * SWITCH_MARGIN >= rate[best]:
        best = last  # a near-tie: keep the drafted shape that ran last (a switch pays a program's first run)
    spec = max((s for s in rate if s.block > 1), key=rate.get, default=None) if best.block == 1 else None
    if spec is not None and ev.drafted < MIN_EVIDENCE:
        return Choice(spec, f"auto shape: {spec.label} (expected {rate[spec]:.2f}x target-only, but only "
                            f"{ev.drafted} drafted calls seen: target-only needs {MIN_EVIDENCE})")
    # keep the evidence fresh (the text may change): every probe_every-th call in a row, or every PROBE_EVERY-th
    # while the best drafted shape is a near miss (the choice rests on a few percent, which the text can move)
    every = PROBE_EVERY if spec is not None and rate[spec] >= PROBE_NEAR else ev.probe_every
    if look and spec is not None and ev.idle >= every - 1:
        if _stale_past(ev, spec):  # the deeper chain's depths are old news: probe it instead
            deeper = max((c for c in rate if c.block > spec.block and not c.tree), key=rate.get, default=None)
            spec = deeper if deeper is not None and rate[deeper] >= DEEP_TRY * rate[spec] else spec
        return Choice(spec, f"auto shape: {spec.label} (probing after {ev.idle} target-only calls: expected "
                            f"{rate[spec]:.2f}x vs target-only 1.00x)", look=True)
    for s in shapes if look else ():  # a tree never run yet whose estimate comes close: try it once
        if s.tree and not ev.tried(s) and s in rate and rate[s] >= explore * rate[best]:
            return Choice(s, f"auto shape: {s.label} (trying it: estimated tau {ev.tau(s, part):.2f} / cost "
                             f"{cost[s]:.2f} = {rate[s]:.2f}x vs best {best.label} {rate[best]:.2f}x)", look=True)
    timed = ev.timed(context) if look and best.block > 1 else None
    for s in sorted(rate, key=rate.get, reverse=True) if timed is not None else ():
        # a drafted shape close to the best whose cycle cost rests on the curve (few of its cycles timed lately: a
        # curve's entries err by 5-15% on this CPU, so one priced too high would never run and never be corrected -
        # session 18, run L: tree 7 at 2.87 target steps by the curve, 2.69 in fixed runs, and auto ran B=4 and B=8)
        if (s.block > 1 and s != best and rate[s] >= COST_TRY * rate[best] and timed.get(s.key, 0.0) < COST_CYCLES
                and ev.last != s.key):
            return Choice(s, f"auto shape: {s.label} (timing it: expected {rate[s]:.2f}x vs best {best.label} "
                             f"{rate[best]:.2f}x, its cost from the curve: {timed.get(s.key, 0.0):.0f} of "
                             f"{COST_CYCLES} cycles timed lately)", look=True)
    if look and _stale_past(ev, best):
        # the depths past this chain are seen in too few cycles (its own cycles never reach them, and the
        # evidence of the last deeper runs decayed): their estimates rest on the prior, so a deeper chain whose
        # estimate comes within DEEP_TRY of the best runs this call's look (the rest of the call then goes on in
        # place with the best shape by what the look saw) - not two calls in a row (short answers may see few
        # cycles of it)
        deeper = max((c for c in rate if c.block > best.block and not c.tree), key=rate.get, default=None)
        if deeper is not None and rate[deeper] >= DEEP_TRY * rate[best] and ev.last != deeper.key:
            return Choice(deeper, f"auto shape: {deeper.label} (depths past {best.label} little seen lately: "
                                  f"expected {rate[deeper]:.2f}x vs {best.label} {rate[best]:.2f}x)", look=True)
    ranked = sorted(rate, key=rate.get, reverse=True)
    nxt = next((s for s in ranked if s != best), best)
    steps = ev.target_steps(context)
    if look and best.block > 1 and rate[best] < REF_BELOW and steps < REF_STEPS and ev.drafted >= MIN_EVIDENCE:
        # the drafted shapes' cost relative to a target step rests on the curve alone here: this call runs
        # target-only, whole, its steps timed over the same positions as the drafted calls' cycles (a target-only
        # rest after a drafted look timed steps at a row's later, fuller positions only: at a 1024-slot cache,
        # GSM8K, tokens 65-256 took 1.44 ms a step against 1.31 for tokens 1-64, and the fitted drafted costs came
        # out ~10-15% low - session 21: tree 7 at 2.33 target steps where it ran at 2.74-2.90, MATH-500 drafted
        # at 0.94x)
        return Choice(Shape(1), f"auto shape: target-only, timing target steps (best drafted {best.label} expected "
                                f"{rate[best]:.2f}x: tau {ev.tau(best, part):.2f} / cycle cost {cost[best]:.2f} "
                                f"target steps; {steps:.0f} steps timed here, the drift from the curve needs "
                                f"{REF_STEPS})", look=True, reference=True)
    if best.block == 1:
        return Choice(best, f"auto shape: target-only (best drafted {nxt.label} expected {rate[nxt]:.2f}x: tau "
                            f"{ev.tau(nxt, part):.2f} / cycle cost {cost[nxt]:.2f} target steps, below the "
                            f"{HURDLE:.2f}x a drafted shape needs)")
    return Choice(best, f"auto shape: {best.label} (expected {rate[best]:.2f}x target-only: tau {ev.tau(best, part):.2f} / "
                        f"cycle cost {cost[best]:.2f} target steps; next {nxt.label} {rate[nxt]:.2f}x)")


def shadow_trees(ev: Evidence, shape: Shape, shapes, costs: dict) -> tuple:
    """Tree budgets whose commits a call of the chain `shape` reports (generate's shadow_trees: each cycle builds
    the tree unverified, ~0.3 ms at 7-15 nodes on the embedded pair's CPU, ~2.5% of a B=8 cycle): the candidate trees
    no deeper than its drafts (a shorter block's trees come from its own block pass, close to the full block's that a
    tree run uses; with the full block, any budget, exactly) and costing at most SHADOW_COST x the chain's
    cycle (the curve's), while one of them has run (or been shadowed) less than TREE_TRY_CYCLES row-cycles, and in
    every SHADOW_EVERY-th drafted call to follow the text. () for target-only and trees."""
    if shape.block <= 1 or shape.tree:
        return ()
    ns = tuple(s.tree for s in shapes if s.tree and (s.tree < shape.block or shape.block == ev.full_block)
               and costs.get(s.key, np.inf) <= SHADOW_COST * costs.get(shape.key, np.inf))
    if ns and (ev.drafted % SHADOW_EVERY == 0 or not all(ev.tried(Shape(ev.full_block, n)) for n in ns)):
        return ns
    return ()


def _stale_past(ev: Evidence, shape: Shape) -> bool:
    """A chain shorter than the full block whose next depth few cycles saw, or none for DEEP_AGE drafted calls."""
    if shape.block <= 1 or shape.tree or shape.block >= ev.full_block:
        return False
    return max(r[shape.block] for r in ev.risk) < DEPTH_PRIOR or ev.depth_age[shape.block] >= DEEP_AGE


def agree(choice: Choice, shapes) -> Choice:
    """Across processes (multi-host), process 0's choice: each process times its own calls, and
    processes running different programs in one mesh would stall. One process: the choice itself."""
    if _process_count() == 1:
        return choice
    shapes = list(shapes)
    i, look, ref = (int(x) for x in _from_process_0([shapes.index(choice.shape), int(choice.look),
                                                      int(choice.reference)]))
    if shapes[i] == choice.shape and bool(look) == choice.look and bool(ref) == choice.reference:
        return choice
    return Choice(shapes[i], f"auto shape: {shapes[i].label} (process 0's choice; here: {choice.reason})", bool(look),
                  bool(ref))


_EVIDENCE: dict = {}
EVIDENCE_VERSION = 6  # part of the on-disk evidence key: bumped when Evidence's fields change meaning (4: tree gains
# paired with shadow trees, tree_cycles counting shadowed cycles; 5: cycle times carry their cache fill; 6: a shadowed
# tree's gain from shadows only)


def _evidence_file() -> str:
    return os.path.join(cache_dir(), "evidence.json")


def _evidence_key(target, drafter) -> str:
    return f"{pair_key(target, drafter)}|{_device_kind()}|v{EVIDENCE_VERSION}"


def evidence_for(target, drafter) -> Evidence:
    """What has been observed on this pair: in memory for this process, first read from the disk cache
    (evidence.json beside the cost curve), so that auto starts from what earlier runs saw (a CLI call
    per prompt learns too)."""
    k = pair_key(target, drafter)
    if k not in _EVIDENCE:
        ev = None
        try:
            with open(_evidence_file()) as f:
                d = json.load(f).get(_evidence_key(target, drafter))
            if d and d.get("full_block") == drafter.config.block_size:
                ev = Evidence(**d)
        except (OSError, ValueError, TypeError):
            ev = None  # unreadable or from another version: start afresh (it is only evidence)
        _EVIDENCE[k] = ev or Evidence(full_block=drafter.config.block_size)
    return _EVIDENCE[k]


def save_evidence(target, drafter) -> None:
    """Write this pair's evidence to the disk cache (atomically; other pairs' entries kept)."""
    k = pair_key(target, drafter)
    if k not in _EVIDENCE:
        return
    path = _evidence_file()
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    table[_evidence_key(target, drafter)] = dataclasses.asdict(_EVIDENCE[k])
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f)
    os.replace(tmp, path)
