"""The automatic shape's policy (the model and the glue's calls: the package docstring). Pure Python and numpy:
no jax, no models, no clock of its own (times come in as `now`)."""
from __future__ import annotations

import dataclasses

import numpy as np

CHAIN_BLOCKS = (2, 4, 8, 16)
TREE_BUDGETS = (3, 7, 15, 31, 63)  # root + nodes = 4 ... 64 verified rows: whole tiles of a dot's rows
_NODES, _WEIGHTS = np.array([-3 ** 0.5, 0.0, 3 ** 0.5]), np.array([1 / 6, 2 / 3, 1 / 6])  # Gauss-Hermite, 3 points


@dataclasses.dataclass(frozen=True)
class Shape:
    block: int  # tokens verified by a chain (anchor + drafts); 1: target-only; a tree: the drafter's block
    tree: int | None = None  # draft-tree nodes (None: a chain)

    key = property(lambda s: "target" if s.block == 1 else (f"tree{s.tree}" if s.tree else f"B{s.block}"))
    label = property(lambda s: "target-only" if s.block == 1 else (f"tree {s.tree}" if s.tree else f"B={s.block}"))


def candidate_shapes(full_block: int, blocks=CHAIN_BLOCKS, trees=TREE_BUDGETS) -> list[Shape]:
    """Target-only, the chains no longer than the drafter's block, and the trees (drafted from the full block)."""
    return [Shape(1)] + [Shape(b) for b in blocks if 2 <= b <= full_block] + [Shape(full_block, n) for n in trees]


@dataclasses.dataclass(frozen=True)
class Choice:
    shape: Shape
    expected_speedup: float  # expected committed tokens per second over target-only's
    reason: str  # one line
    look: bool = False  # run look_tokens tokens of it, then choose the rest of the call (choose(rest=True))


@dataclasses.dataclass
class Evidence:
    """What calls on one pair showed; JSON-serialisable (dataclasses.asdict, Evidence(**d))."""
    full_block: int
    depth: list = dataclasses.field(default_factory=list)  # [d - 1]: draft d's logit about the text's level (its
    # data's natural parameters [eta, lam]: precision lam, mean eta / lam; decayed)
    text: list = dataclasses.field(default_factory=lambda: [0.0, 1.0])  # the text's level: [mean, variance]
    later: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # [eta, lam]: the offset of cycles past an
    # answer's first look_tokens tokens (answers draft better as they go)
    open: dict = dataclasses.field(default_factory=dict)  # the call being recorded: text prior and its counts
    own: dict = dataclasses.field(default_factory=dict)  # chain block B < full (str) -> `depth` of its own block
    gain: dict = dataclasses.field(default_factory=dict)  # tree key -> [tree tokens, chain tokens, cycles] (decayed)
    cost: dict = dataclasses.field(default_factory=dict)  # context -> the cost filter {"t", "keys", "x", "P"}
    calls: int = 0  # calls recorded (seeds the sampler's draws)

    def __post_init__(self):
        self.depth = self.depth or [[0.0, 0.0] for _ in range(self.full_block - 1)]


def monotone(curve: dict, shapes) -> dict:
    """The curve with each family (chains by block, trees by budget) made non-decreasing: a longer chain or a
    larger tree never costs less, so a measurement's noise must not rank them backwards."""
    out = {"target": 1.0, **curve}
    for fam in ([s for s in shapes if s.block > 1 and not s.tree], [s for s in shapes if s.tree]):
        top = 0.0
        for s in sorted(fam, key=lambda s: s.tree or s.block):
            top = out[s.key] = max(top, float(out[s.key]))
    return out


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30, 30)))


@dataclasses.dataclass(frozen=True)
class AutoPolicy:
    look_tokens: int = 64  # tokens a drafted call runs before its rest is chosen at its own answer's level
    text_sd: float = 0.06  # logit sd of the text's acceptance level changing from one call to the next
    answer_sd: float = 0.5  # logit sd of one answer's level about its text's
    memory: float = 64.0  # drafted calls after which the per-depth profile's and tree gains' evidence counts half
    prior_cycles: float = 4.0  # pseudo-cycles behind each prior (a depth: the depth before's logit; a tree: no gain)
    shadow_cycles: float = 64.0  # a chain call shadows the trees whose gain rests on fewer (decayed) cycles
    curve_sd: float = 0.1  # prior log-sd of a cost-curve entry against real calls (half of it shared by all)
    drift_sd: float = 0.1  # log-sd of the machine's speed change over one minute (the cost filter's random walk)
    call_sd: float = 0.06  # log-sd of one call's seconds per cycle about the cost model (load, timer)
    horizon: float = 4.0  # calls over which what a look shows is used (the value of exploring; 0: never explore)
    draws: int = 64  # posterior draws that value a look
    own_sd: float = 0.1  # logit sd of a chain of B < full's own-block profile about the full block's, per depth
    seed: int = 0  # the draws' stream: a choice is a function of the evidence and this

    def __post_init__(self):
        for f in dataclasses.fields(self)[:-1]:  # every knob but the seed: > 0 (horizon, shadow_cycles: 0 is off)
            v, zero = getattr(self, f.name), f.name in ("horizon", "shadow_cycles")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if zero else v > 0):
                raise ValueError(f"AutoPolicy.{f.name} must be a number {'>=' if zero else '>'} 0, got {v!r}")

    def profile(self, ev: Evidence, block: int | None = None, var: bool = False):
        """[D]: per draft depth, the posterior mean of the logit of its acceptance (given the drafts before it were
        accepted) about the text's level (var: and [D] its variance). The full block's: a prior of prior_cycles
        Bernoulli cycles at the depth before's (0 at depth 1), its data and each chain of B < full's (own_sd wider);
        a chain of B < full's (it drafts with its own block): the full block's from the rest, own_sd wider, and its."""
        k, s2 = self.prior_cycles / 4, self.own_sd ** 2
        own, e, m, prev = {int(b): np.array(o) for b, o in ev.own.items()}, np.array(ev.depth, float), [], 0.0
        for o in own.values():  # a chain's data about the full block's: [eta, lam] / (1 + lam own_sd^2)
            e[:len(o)] += o / (1 + s2 * o[:, 1:])
        for eta, lam in e:
            m.append(prev := (eta + k * prev) / (lam + k))
        m, v = np.array(m), 1.0 / (e[:, 1] + k)
        if block and 1 < block < ev.full_block:
            o = own.get(block, np.zeros((block - 1, 2)))
            j, q = len(o), o / (1 + s2 * o[:, 1:])
            w = 1.0 / (1.0 / (r := e[:j, 1] + k - q[:, 1]) + s2)  # its prior: the full block's without its data
            m[:j], v[:j] = (o[:, 0] + w * (m[:j] * (e[:j, 1] + k) - q[:, 0]) / r) / (o[:, 1] + w), 1.0 / (o[:, 1] + w)
        return (m, v) if var else m

    def taus(self, ev: Evidence, shapes, level=(0.0, 0.0), n: int = 1, shift=None) -> np.ndarray:
        """[n, shapes]: expected tokens committed per cycle over answers whose level is N(level[0], level[1]) (a
        harmonic mean, 3-point quadrature: what fixes throughput). A chain of B: 1 + sum over k < B of P(drafts 1..k
        accepted) (its block's profile + shift[B], [n, D]). A tree of n nodes: its gain over the full block's chain to
        its depth (min(n, D) + 1 tokens) times that chain's, at least a smaller tree's."""
        u = np.broadcast_to(np.asarray(level[0], float), (n,))
        prof = {b: self.profile(ev, b) for b in {s.block for s in shapes}}
        def chain(b, c):  # [n, 3]: tokens a chain of c commits on block b's profile, per quadrature node
            x = prof[b] + (shift or {}).get(b, np.zeros((n, 1)))
            x = x[:, None, :] + u[:, None, None] + _NODES[None, :, None] * level[1] ** 0.5
            return 1.0 + np.cumprod(_sigmoid(x), axis=2)[:, :, :c - 1].sum(axis=2)
        hmean = lambda t: 1.0 / ((1.0 / t) @ _WEIGHTS)
        out, top = np.ones((n, len(shapes))), np.zeros(n)
        for i, s in sorted(enumerate(shapes), key=lambda x: (x[1].tree or 0, x[1].block)):
            if s.block > 1 and not s.tree:
                out[:, i] = hmean(chain(s.block, s.block))
            elif s.tree:  # the gain's Gamma posterior mean, its prior: gain 1 over prior_cycles cycles
                cap, (t, c, _) = min(s.tree, ev.full_block - 1) + 1, ev.gain.get(s.key, (0.0, 0.0, 0.0))
                w = self.prior_cycles * hmean(ch := chain(ev.full_block, cap))
                top = out[:, i] = np.maximum(top, hmean(np.minimum(((t + w) / (c + w))[:, None] * ch, cap)))
        return out

    def _level(self, ev: Evidence, rest: bool) -> tuple:
        """(mean, variance) of the level of the next answer, or (rest) of the answer being recorded."""
        m, v = ev.text
        if not rest or not ev.open:
            return m, v + self.answer_sd ** 2
        u, w = self._answer(ev)  # the rest: this answer's level plus the later offset (spread as an answer's)
        return u + ev.later[0] / (ev.later[1] + self.prior_cycles / 4), w + self.answer_sd ** 2

    def _answer(self, ev: Evidence) -> tuple:
        """The open call's answer level from its cycles in its first look_tokens tokens (later ones measure the
        later offset): (mean, variance), Newton / Laplace with the prior N(text mean, text variance + answer_sd^2)."""
        m0, s2, n = ev.open["m"], ev.open["v"] + self.answer_sd ** 2, np.array(ev.open["n"])[0]  # n: [depth, acc / rej]
        b, u, H = self.profile(ev, ev.open.get("b")), m0, 1.0 / s2
        for _ in range(6):
            p = _sigmoid(b + u)
            H = float((n.sum(-1) * p * (1 - p)).sum()) + 1.0 / s2
            u += (float((n[:, 0] - n.sum(-1) * p).sum()) - (u - m0) / s2) / H
        return u, 1.0 / H

    def _filter(self, ev: Evidence, context: str, keys: list) -> dict:
        """The cost filter of `context`: x = [log seconds of a target step now, log(cost / curve) of each drafted
        shape], covariance P. Prior: the step unknown, each drafted entry N(0, curve_sd^2), half of it shared."""
        f = ev.cost.get(context)
        if f is None or f["keys"] != keys:
            k, P = len(keys), np.diag([1e4] + [0.0] * len(keys))
            P[1:, 1:] = 0.5 * self.curve_sd ** 2 * (np.ones((k, k)) + np.eye(k))
            f = ev.cost[context] = {"t": None, "keys": list(keys), "x": [0.0] * (k + 1), "P": P.tolist()}
        return f

    def costs(self, ev: Evidence, shapes, curve: dict, context: str = "") -> np.ndarray:
        """[1, shapes]: cycle time in target steps: the curve x exp(the filter's log correction)."""
        curve, keys = monotone(curve, shapes), [s.key for s in shapes if s.block > 1]
        corr = dict(zip(keys, self._filter(ev, context, keys)["x"][1:]))
        return np.array([[1.0 if s.block == 1 else curve[s.key] * np.exp(corr[s.key]) for s in shapes]])

    def _time(self, ev: Evidence, shapes, curve, shape: Shape, per_cycle: float, context: str, now: float) -> None:
        """One call's seconds per cycle into the filter: y = log(them / curve entry) (Kalman, after the random walk)."""
        f = self._filter(ev, context, [s.key for s in shapes if s.block > 1])
        y = float(np.log(per_cycle / monotone(curve, shapes)[shape.key]))
        x, P = np.array(f["x"]), np.array(f["P"])
        if f["t"] is not None:
            P[0, 0] += self.drift_sd ** 2 * max(0.0, now - f["t"]) / 60.0
        h = np.eye(len(x))[0] + (np.eye(len(x))[1 + f["keys"].index(shape.key)] if shape.block > 1 else 0.0)
        K = P @ h / (h @ P @ h + self.call_sd ** 2)
        x, P = x + K * (y - h @ x), P - np.outer(K, h @ P)
        f.update(t=float(now), x=x.tolist(), P=(0.5 * (P + P.T)).tolist())

    def record(self, ev: Evidence, shapes, curve: dict, shape: Shape, acceptance_lengths, chain_lengths=None, *,
               shadows=None, seconds=None, cycles=None, context: str = "", now: float | None = None,
               offset: int = 0) -> None:
        """One call's outcome (offset > 0: the rest of the call whose look was recorded last). acceptance_lengths:
        tokens committed per cycle per row; chain_lengths: per cycle what the full-block chain commits (-n: at least
        n; None: a chain's own commits); shadows: {tree budget: per row and cycle, that tree's commit (0: unknown)};
        `seconds` over `cycles` cycles, timed at clock `now` (None: not a timing, e.g. a run that compiled)."""
        if seconds and cycles and now is not None:
            self._time(ev, shapes, curve, shape, seconds / cycles, context, float(now))
        D = ev.full_block - 1
        if offset == 0:  # a new answer: the text may have moved since the last; drafted calls age the evidence
            ev.calls, ev.text[1] = ev.calls + 1, ev.text[1] + self.text_sd ** 2
            ev.open = {"m": ev.text[0], "v": ev.text[1], "n": np.zeros((2, D, 2)).tolist(), "b": shape.block}
            keep = 0.5 ** (1.0 / self.memory) if shape.block > 1 else 1.0
            ev.depth, ev.later = [[eta * keep, lam * keep] for eta, lam in ev.depth], [x * keep for x in ev.later]
            ev.own = {k: [[eta * keep, lam * keep] for eta, lam in o] for k, o in ev.own.items()}
            ev.gain = {k: [v * keep for v in g] for k, g in ev.gain.items()}
        if shape.block == 1:
            return
        if chain_lengths is None and not shape.tree:  # a chain of B < full accepted whole: no word past it
            chain_lengths = [[-x if x >= shape.block <= D else x for x in row] for row in acceptance_lengths]
        # a tree's record of the chain is censored where the tree's greedy chain ends, where the drafter is unsure:
        # only its first draft (always a node) is verified in every cycle, so only depth 1 is taken from it
        top = 1 if shape.tree else D
        n = np.zeros((2, D, 2))  # this part's [accepted, rejected] per (before / past look_tokens, depth)
        for acc, row in zip(acceptance_lengths, chain_lengths or ()):
            pos = offset + 1 + np.concatenate([[0], np.cumsum(acc)[:-1]])  # each cycle's first position
            for x, at in zip(row, pos):
                k, part = (min(abs(int(x)) - 1, top) if x else -1), int(at >= self.look_tokens)
                n[part, :max(k, 0), 0] += 1.0
                if x > 0 and k < top:
                    n[part, k, 1] += 1.0
        ev.open["n"] = (np.array(ev.open["n"]) + n).tolist()
        u, w = self._answer(ev)  # the answer's level; the text's, regressed on it (answer = text + N(0, sd^2))
        m0, v0, s2 = ev.open["m"], ev.open["v"], ev.open["v"] + self.answer_sd ** 2
        ev.text = [m0 + v0 / s2 * (u - m0), v0 - (v0 / s2) ** 2 * (s2 - w)]
        dl, b = ev.later[0] / (ev.later[1] + self.prior_cycles / 4), self.profile(ev, shape.block)  # Laplace
        p = _sigmoid(b[None, :] + u + np.array([[0.0], [dl]]))  # terms at the answer's level: each depth's (its
        H, g = n.sum(-1) * p * (1 - p), n[..., 0] - n.sum(-1) * p  # block's profile) from the first look_tokens
        own = str(shape.block) if shape.block < ev.full_block else None  # tokens, the later offset's from the rest
        old = ev.own.get(own, [[0.0, 0.0]] * (shape.block - 1)) if own else ev.depth  # B < full: its own block's
        new = [[eta + h * bd + gd, lam + h] for (eta, lam), h, bd, gd in zip(old, H[0], b, g[0])]
        ev.own, ev.depth = ({**ev.own, own: new}, ev.depth) if own else (ev.own, new)
        ev.later = [ev.later[0] + float(H[1].sum()) * dl + float(g[1].sum()), ev.later[1] + float(H[1].sum())]
        for size, rows in (shadows or {}).items():  # paired with this chain's own commits, cycle by cycle; where the
            cap = min(int(size), D) + 1  # text ended inside the tree's walk (0), once the row has (not a look that
            g = ev.gain.setdefault(Shape(ev.full_block, int(size)).key, [0.0, 0.0, 0.0])  # goes on), the tree would
            for acc, crow, trow in zip(acceptance_lengths, chain_lengths, rows):  # have committed what was left
                end, left = offset > 0 or sum(acc) + 1 < self.look_tokens, np.cumsum(acc[::-1])[::-1]
                pair = [(t or min(int(r), cap), min(abs(c), cap)) for c, t, r in zip(crow, trow, left)
                        if (t > 0 or end) and c and (c > 0 or -c >= cap)]
                g[:] = [g[0] + sum(t for t, _ in pair), g[1] + sum(c for _, c in pair), g[2] + len(pair)]

    def shadow_trees(self, ev: Evidence, shape: Shape, shapes) -> tuple:
        """Tree budgets a call of the chain `shape` should report (its cycles build them unverified): the trees it
        can build (shallower than its block, or any with the full block) whose gain rests on few cycles."""
        if shape.block <= 1 or shape.tree:
            return ()
        return tuple(s.tree for s in shapes if s.tree and (s.tree < shape.block or shape.block == ev.full_block)
                     and ev.gain.get(s.key, (0, 0, 0))[2] < self.shadow_cycles)

    def _explore(self, ev: Evidence, shapes, curve, context, tau, cost, best) -> tuple:
        """(shape index, value) of the most valuable look, a one-step knowledge gradient: over `horizon` calls, the
        expected gain per call from how a look at s would move the estimates (draws of the moved posterior means),
        less what the look is expected to lose against the best. A drafted look moves the text's level (one answer:
        by sd v / (v + answer_sd^2)^0.5), s's cycle cost (one timing, call_sd; target-only times steps: the best's)
        and a chain's block's profile (its cycles per depth); a tree's gain: a full-block chain's shadows measure it."""
        rng, n, (m, v), shift = np.random.default_rng([self.seed, ev.calls]), self.draws, ev.text, {}
        a2 = self.answer_sd ** 2
        u = m + rng.normal(0, 1, n) * v / (v + a2) ** 0.5
        r_u = self.taus(ev, shapes, (u, v * a2 / (v + a2) + a2), n) / cost  # [n, shapes] moved level
        for i, s in ((i, s) for i, s in enumerate(shapes) if s.block > 1 and not s.tree):
            b, V = (x[:s.block - 1] for x in self.profile(ev, s.block, var=True))
            p = _sigmoid(b + m)  # a look's Fisher information per depth: its cycles reaching it x p (1 - p)
            info = self.look_tokens / tau[i] * np.cumprod(np.r_[1.0, p[:-1]]) * p * (1 - p)
            shift[s.block] = rng.normal(0, 1, (n, ev.full_block - 1)) * np.pad(
                V * (info / (1 + V * info)) ** 0.5, (0, ev.full_block - s.block))
        r_o = self.taus(ev, shapes, self._level(ev, False), n, shift) / cost  # [n, shapes] moved profiles
        P = np.diag(np.array(self._filter(ev, context, [s.key for s in shapes if s.block > 1])["P"]))[1:]
        moved = np.concatenate([[0.0], (P ** 2 / (P + self.call_sd ** 2)) ** 0.5])  # per shape (shapes' order)
        c_m = cost * np.exp(rng.normal(0, 1, (n, 1)) * moved)  # [n, shapes] moved costs
        rate, out, gain = tau / cost, (best, 0.0), lambda r: float(np.maximum(r - 1.0, 0.0).mean())
        for i, s in ((i, s) for i, s in enumerate(shapes) if i != best):
            if s.block == 1:  # timing steps: the best's cost relative to a step
                value = self.horizon * gain(c_m[:, best] / tau[best])
            else:
                (t, _, k), g, r = ev.gain.get(s.key, (0.0, 0.0, 0.0)), 1.0, r_o[:, i]
                if s.tree and k < self.shadow_cycles:
                    w = t + self.prior_cycles * tau[i]
                    g = 1.0 + (rng.gamma(w, size=n) / w - 1.0) * self.shadow_cycles / (k + self.shadow_cycles)
                elif s.tree:  # run as itself: it shows the full block's first draft only
                    r = rate[i]
                value = self.horizon * (gain(r_u[:, i] / r_u[:, best]) + gain(g * r * cost[i] / c_m[:, i] / rate[best]))
            value -= 1.0 - rate[i] / rate[best]
            if value > out[1]:
                out = (i, value)
        return out

    def choose(self, ev: Evidence, shapes, curve: dict, *, context: str = "", rest: bool = False) -> Choice:
        """The shape of highest expected committed tokens per second for the next call, or (rest) for the rest of the
        call whose look was recorded last, at its answer's level; or a look at another, where worth it (`_explore`)."""
        shapes = list(shapes)
        full = Shape(ev.full_block)
        if not any(lam for _, lam in ev.depth):
            return Choice(full, 1.0, f"auto shape: {full.label} (no acceptance seen yet: it shows every depth)", True)
        tau, cost = self.taus(ev, shapes, self._level(ev, rest))[0], self.costs(ev, shapes, curve, context)[0]
        rate = tau / cost
        best, nxt = np.argsort(-rate)[[0, min(1, len(shapes) - 1)]]
        i, value = self._explore(ev, shapes, curve, context, tau, cost, best) if not rest and self.horizon else (0, 0)
        if value > 0:
            s = shapes[i]
            why = f"a look is worth {value:+.3f} of a call: expected {rate[i]:.2f}x vs {shapes[best].label} " \
                  f"{rate[best]:.2f}x"
            if s.tree and s.tree in self.shadow_trees(ev, full, shapes):  # its gain: in a chain's shadows
                return Choice(full, float(rate[shapes.index(full)]), f"auto shape: {full.label} (exploring "
                              f"{s.label}: {why}; its gain is measured in this chain's shadow trees)", look=True)
            return Choice(s, float(rate[i]), f"auto shape: {s.label} (exploring: {why})", look=True)
        b, r = shapes[best], float(rate[best])
        what = f": tau {tau[best]:.2f} / cycle cost {cost[best]:.2f} target steps" if b.block > 1 else ""
        return Choice(b, r, f"auto shape: {b.label} (expected {r:.2f}x target-only{what}; next {shapes[nxt].label} "
                            f"{rate[nxt]:.2f}x)", look=not rest and b.block > 1)
