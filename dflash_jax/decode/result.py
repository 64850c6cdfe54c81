"""What a decode returns: `GenerationResult`, read from the final DecodeState (`collect`), two parts of one
call joined (`join`: auto's look, then the rest), and the shadow trees' commits (`shadow_paths`)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # per row: generated ids (first token included; a stop token is kept)
    acceptance_lengths: list[list[int]]  # per row: tokens committed in each decode cycle
    prefill_time: float  # seconds, compile excluded
    decode_time: float  # seconds, compile excluded
    compile_time: float  # seconds spent compiling in this call (0 when cached)
    cycles: int  # decode cycles run (loop iterations)
    block_size: int  # 1 = target-only
    tree_budget: int | None = None  # draft-tree nodes per cycle (None: chain)
    auto_reason: str | None = None  # with block_size / tree_budget "auto": the choice and why
    auto_look: bool = False  # ... and whether the call explored: its first shape was run for what it shows (the
    # first call, a look at another shape), not as the best estimate
    # per row and decode cycle (speculative runs): what the chain of the drafter's full block would have
    # committed (1 + accepted drafts, before stop cuts; negative -n: at least n, censored)
    chain_lengths: list[list[int]] = dataclasses.field(default_factory=list)
    # chain calls with shadow_trees: {N: per row and decode cycle, what a tree of N nodes would have committed
    # there (1 + the depth the committed text reaches in it; 0: unknown, the text so far ends inside it)}
    shadow_lengths: dict = dataclasses.field(default_factory=dict)
    texts: list[str] | None = None  # per row: the decoded tokens, when generate() had a tokenizer

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by the decode loop (the first token of each row comes from prefill)."""
        return sum(sum(a) for a in self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length over all cycles of all rows (1.0 for target-only decoding)."""
        lens = [x for row in self.acceptance_lengths for x in row]
        return float(np.mean(lens)) if lens else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else float("nan")

    @property
    def time_per_output_token(self) -> float:
        return self.decode_time / max(self.decode_tokens, 1)

    def histogram(self, max_len: int | None = None) -> list[int]:
        m = max_len or self.block_size
        h = [0] * (m + 1)
        for row in self.acceptance_lengths:
            for x in row:
                h[min(x, m)] += 1
        return h


def collect(state, B: int, skip: int, Bk, tree, trees=None, shadow=()):
    """GenerationResult of the rows 0..B-1 for the cycles after the first `skip` (tokens: those generated in
    them), and the host copies (out, gen_len) of every row. `trees`: the loop's shadow trees (programs.loop), whose
    commits for the budgets `shadow` the result reports."""
    from ..weights import fetch
    out, gen_len, hist = (fetch(x) for x in (state.out, state.gen_len, state.acc_hist))
    cycles = int(fetch(state.cycle))
    accs = [[int(x) for x in hist[i, skip:cycles] if x > 0] for i in range(B)]
    before = [int(gen_len[i]) - sum(a) if skip else 0 for i, a in enumerate(accs)]
    toks = [out[i, before[i]:gen_len[i]].tolist() for i in range(B)]
    chains = []
    if state.chain_hist is not None:
        ch = fetch(state.chain_hist)
        chains = [[int(x) for x in ch[i, skip:cycles] if x != 0] for i in range(B)]
    res = GenerationResult(tokens=toks, acceptance_lengths=accs, prefill_time=0.0, decode_time=0.0, compile_time=0.0,
                           cycles=cycles - skip, block_size=Bk, tree_budget=tree, chain_lengths=chains)
    if trees is not None and shadow:
        tk, pa = (fetch(x) for x in trees)
        res.shadow_lengths = {n: [] for n in shadow}
        for i in range(B):
            cyc = [c for c in range(skip, cycles) if hist[i, c] > 0]
            paths = shadow_paths(tk[i, cyc], pa[i, cyc], out[i, :gen_len[i]], max(before[i], 1), accs[i], Bk - 1)
            for n in shadow:
                res.shadow_lengths[n].append([0 if p is None else 1 + sum(f <= n for f in p) for p in paths])
    return res, (out, gen_len)


def shadow_paths(tokens, parents, text, first: int, commits, depth: int) -> list:
    """Per cycle of one row, the flattened indices of the shadow tree's nodes the committed text walks through
    (a tree of n <= the recorded nodes holds indices 1..n: node order is score order, parents first), or None
    where the text so far ends before the walk does. tokens / parents [cycles, nodes] (parent 0: the root, -1:
    no node); text: the row's generated tokens; first: the index in it of the first cycle's first commit;
    commits: tokens each cycle committed; depth: the drafts' depth (the tree's deepest level)."""
    out, g = [], int(first)
    for tk, pa, n in zip(tokens, parents, commits):
        child = {(int(p), int(t)): f + 1 for f, (p, t) in enumerate(zip(pa, tk)) if p >= 0}
        path, cur = [], 0
        for d in range(depth):
            if g + d >= len(text):
                path = None  # the text ends inside the walk: unknown
                break
            cur = child.get((cur, int(text[g + d])))
            if cur is None:
                break
            path.append(cur)
        out.append(path)
        g += int(n)
    return out


def join(res: GenerationResult, more: GenerationResult) -> GenerationResult:
    """`res` (a call's first part) extended in place by `more` (the rest, run on in the same decode state):
    tokens, acceptance and chain lengths appended per row, shadow lengths (0: unknown in a part without them),
    cycles and compile time added, the shape the rest's. Decode time: the caller adds it."""
    for n in set(res.shadow_lengths) | set(more.shadow_lengths):  # a part without them: unknown (0) there
        a = res.shadow_lengths.get(n) or [[0] * len(r) for r in res.acceptance_lengths]
        b = more.shadow_lengths.get(n) or [[0] * len(r) for r in more.acceptance_lengths]
        res.shadow_lengths[n] = [x + y for x, y in zip(a, b)]
    for i in range(len(res.tokens)):
        res.tokens[i] = res.tokens[i] + more.tokens[i]
        res.acceptance_lengths[i] = res.acceptance_lengths[i] + more.acceptance_lengths[i]
        if more.chain_lengths:
            res.chain_lengths[i] = (res.chain_lengths[i] if res.chain_lengths else []) + more.chain_lengths[i]
    res.compile_time += more.compile_time
    res.cycles += more.cycles
    res.block_size, res.tree_budget = more.block_size, more.tree_budget
    return res
