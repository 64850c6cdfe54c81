"""The load-aware shape: per decode chunk, the shape expected to commit the most tokens per second at the current
load. Pure Python (no jax, no clock): the scheduler passes in what it measured.

- `curve`: {batch bucket: {shape: seconds per cycle}}, timed at start-up on the engine's own programs (every row
  of the bucket active). A chunk runs on the smallest bucket holding the busy slots, so as more requests are in
  flight the cycles grow dearer - a verify of many rows turns compute-bound - and a smaller block, or no
  speculation, can commit more per second.
- `Acceptance`: committed tokens per row-cycle (tau) per shape: a prior per shape (measured with the curve), then
  what the chunks showed. A shape not run lately is predicted from its prior, scaled by how the drafted chunks
  compared with their own priors (the text being served drafts better or worse than the start-up prompts).
- `best_shape`: the shape with the largest active rows x tau / seconds per cycle at that bucket; `choose` adds a
  bounded exploration (a drafted chunk now and then while target-only leads by little), so the acceptance estimate
  keeps learning from the traffic.
"""
from __future__ import annotations

import dataclasses

TARGET_ONLY = "off"  # the name of target-only decoding in the curve and the estimates


def cycle_seconds(curve: dict, batch: int, shape: str) -> float:
    """Seconds per cycle of `shape` at `batch` rows: the curve's value at that bucket, else linear between the two
    measured buckets around it (clamped at the ends)."""
    pts = sorted((b, row[shape]) for b, row in curve.items() if shape in row)
    if not pts:
        raise ValueError(f"shape {shape} has no measured cost")
    for (b0, c0), (b1, c1) in zip(pts, pts[1:]):
        if b0 <= batch <= b1:
            return c0 + (c1 - c0) * (batch - b0) / (b1 - b0)
    return pts[0][1] if batch < pts[0][0] else pts[-1][1]


def expected_rate(active: int, batch: int, curve: dict, tau: float, shape: str) -> float:
    """Expected committed tokens per second of `active` rows decoding with `shape` on a batch bucket of `batch`."""
    return active * tau / cycle_seconds(curve, batch, shape)


def best_shape(active: int, batch: int, curve: dict, taus: dict) -> tuple[str, dict]:
    """(the shape of the largest expected rate, {shape: expected tokens per second}) among the shapes of `taus`
    (target-only: tau 1). Ties go to the earlier shape in `taus`."""
    if not taus:
        raise ValueError("no candidate shapes")
    rates = {s: expected_rate(max(active, 1), batch, curve, t, s) for s, t in taus.items()}
    best = max(rates, key=lambda s: (rates[s], -list(taus).index(s)))
    return best, rates


def choose(active: int, batch: int, curve: dict, taus: dict, *, since_drafted: int = 0, explore_every: int = 32,
           margin: float = 0.85) -> tuple[str, dict, bool]:
    """`best_shape`, except that after `explore_every` chunks without a drafted one the best drafted shape runs
    once if its expected rate is within `margin` of the best: acceptance is only seen while drafting, and the text
    served may draft better than the priors say. (shape, expected rates, whether it explores)."""
    best, rates = best_shape(active, batch, curve, taus)
    drafted = {s: r for s, r in rates.items() if s != TARGET_ONLY}
    if best == TARGET_ONLY and drafted and since_drafted >= explore_every:
        alt = max(drafted, key=lambda s: (drafted[s], -list(taus).index(s)))
        if drafted[alt] >= margin * rates[best]:
            return alt, rates, True
    return best, rates, False


@dataclasses.dataclass
class Acceptance:
    """Committed tokens per row-cycle of each shape: priors, then decayed sums of what the chunks showed."""
    prior: dict  # shape -> tau measured at start-up (target-only: 1)
    decay: float = 0.9  # per observed chunk: older chunks weigh less as the traffic changes
    trust: float = 16.0  # row-cycles of a shape's own evidence that weigh as much as the pooled prediction
    seen: dict = dataclasses.field(default_factory=dict)  # shape -> [tokens, row-cycles] (decayed)
    pooled: list = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # [observed - 1, prior - 1] x row-cycles

    def observe(self, shape: str, tokens: int, row_cycles: int) -> None:
        """A chunk of `shape` committed `tokens` over `row_cycles` (active rows x cycles; a row's last cycle may
        commit less: its budget or a stop token)."""
        if row_cycles <= 0 or shape == TARGET_ONLY:
            return
        for v in self.seen.values():
            v[0] *= self.decay
            v[1] *= self.decay
        self.pooled = [x * self.decay for x in self.pooled]
        t = self.seen.setdefault(shape, [0.0, 0.0])
        t[0] += tokens
        t[1] += row_cycles
        self.pooled[0] += tokens - row_cycles
        self.pooled[1] += (self.prior.get(shape, 1.0) - 1.0) * row_cycles

    def scale(self) -> float:
        """How the served text drafts against the priors (1: as well as the start-up prompts)."""
        obs, pri = self.pooled
        return obs / pri if pri > 1e-9 else 1.0

    def tau(self, shape: str) -> float:
        if shape == TARGET_ONLY:
            return 1.0
        pred = 1.0 + (self.prior.get(shape, 1.0) - 1.0) * max(self.scale(), 0.0)
        tokens, cycles = self.seen.get(shape, (0.0, 0.0))
        if cycles <= 0:
            return pred
        w = cycles / (cycles + self.trust)
        return w * tokens / cycles + (1 - w) * pred

    def taus(self, shapes) -> dict:
        return {s: self.tau(s) for s in shapes}
