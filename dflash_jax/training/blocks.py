"""Random-anchor blocks and the deterministic batch schedule.

A *block* is [anchor token, mask x (B-1)] at positions p .. p+B-1, where the anchor p is a response
position with at least one following token (prompt_len <= p <= len-2). Its labels are the tokens at
p+1 .. p+B-1 (positions past the end are masked). The drafter sees the target context strictly
before p plus its own block (`drafter.draft_hidden_train`).

Everything here is numpy and deterministic: the anchors of a sequence depend only on
(seed, epoch, prompt id), the order of sequences only on (seed, epoch), so any step's batch can be
rebuilt from the step number alone - which is what makes resuming exact.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .data import SequenceData
from .records import DataError

EVAL_EPOCH = 2**31 - 1  # the anchor stream of held-out evaluation (never a training epoch)


def sample_anchors(prompt_len: int, length: int, num_anchors: int, seed: int, epoch: int, seq_id: int) -> np.ndarray:
    """Sorted anchor positions: up to `num_anchors` distinct response positions p with p + 1 < length."""
    n = length - 1 - prompt_len  # candidates prompt_len .. length-2
    if n <= 0:
        return np.zeros((0,), np.int32)
    rng = np.random.default_rng([int(seed), int(epoch), int(seq_id)])
    k = min(num_anchors, n)
    pos = prompt_len + rng.choice(n, size=k, replace=False)
    return np.sort(pos).astype(np.int32)


def default_buckets(max_len: int, ratio: float = 1.125, align: int = 16, start: int = 32) -> list[int]:
    """Padded lengths: `start`, then steps of `ratio` (rounded up to `align`) up to max_len (rounded to 16).

    Each bucket is one compiled training step; ratio 1.125 bounds the padding a bucket adds to 12.5%
    (about 6% on average) at 6 programs per doubling of length (33 up to 3072)."""
    top = int(math.ceil(max_len / 16) * 16)
    out, x = [], float(start)
    while True:
        b = int(math.ceil(x / align) * align)
        if b >= top:
            break
        if not out or b > out[-1]:
            out.append(b)
        x *= ratio
    out.append(top)
    return out


def padding_fraction(batches) -> float:
    """Padded token slots / all token slots over host batches (dicts with tokens [..., T] and lengths)."""
    real = total = 0
    for b in batches:
        real += int(np.asarray(b["lengths"]).sum())
        total += int(np.asarray(b["tokens"]).size)
    return 1.0 - real / total if total else 0.0


def bucket_for(n: int, buckets) -> int:
    for b in buckets:
        if b >= n:
            return int(b)
    raise DataError(f"a sequence of {n} tokens is longer than the largest length bucket {max(buckets)}")


def build_batch(data: SequenceData, rows, T: int, num_anchors: int, seed: int, epoch: int) -> dict:
    """Arrays of one micro-batch. rows: sequence indices into `data` (-1 = an empty padding row).

    tokens [R, T] int32 (0-padded), lengths [R] int32, anchor_pos [R, A] int32, anchor_valid [R, A] bool.
    """
    R = len(rows)
    tokens = np.zeros((R, T), np.int32)
    lengths = np.zeros((R,), np.int32)
    anchor_pos = np.zeros((R, num_anchors), np.int32)
    anchor_valid = np.zeros((R, num_anchors), bool)
    for r, i in enumerate(rows):
        if i < 0:
            continue
        s = data.seq(int(i))
        if len(s) > T:
            raise DataError(f"sequence {int(data.ids[i])} has {len(s)} tokens, more than the padded length {T}")
        tokens[r, :len(s)] = s
        lengths[r] = len(s)
        a = sample_anchors(int(data.prompt_lens[i]), len(s), num_anchors, seed, epoch, int(data.ids[i]))
        anchor_pos[r, :len(a)] = a
        anchor_valid[r, :len(a)] = True
    return {"tokens": tokens, "lengths": lengths, "anchor_pos": anchor_pos, "anchor_valid": anchor_valid}


def stack_batches(batches: list[dict]) -> dict:
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


@dataclasses.dataclass
class BatchSchedule:
    """Which sequences each optimizer step trains on.

    Each epoch is a fresh permutation (seeded by (seed, epoch)) cut into steps of
    batch_size * grad_accum sequences; the incomplete tail of an epoch is dropped (a different tail
    every epoch).

    Length grouping (`group_steps` > 0): the permutation is cut into windows of group_steps steps;
    inside a window the sequences are sorted by length, cut into steps (so a step, and each of its
    micro-batches, holds sequences of similar length and pads little), and the steps of the window
    are shuffled (seeded), so lengths do not drift through the epoch."""
    data: SequenceData
    batch_size: int
    grad_accum: int
    num_anchors: int
    seed: int
    buckets: list[int]
    group_steps: int = 0

    def __post_init__(self):
        per_step = self.batch_size * self.grad_accum
        if len(self.data) < per_step:
            raise DataError(
                f"the training set has {len(self.data)} sequences, fewer than one optimizer step needs "
                f"(train.batch_size {self.batch_size} x train.grad_accum {self.grad_accum} = {per_step}); "
                f"generate more data or lower the batch size")
        self.steps_per_epoch = len(self.data) // per_step
        self._perm_cache: dict = {}
        lens = self.data.lengths
        if lens.max() > max(self.buckets):
            raise DataError(f"the longest sequence has {lens.max()} tokens, more than the largest length bucket "
                            f"{max(self.buckets)} (train.length_buckets / data.max_length)")

    def position(self, step: int) -> tuple[int, int]:
        return step // self.steps_per_epoch, step % self.steps_per_epoch

    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perm_cache.get(epoch)
        if p is None:
            rng = np.random.default_rng([int(self.seed), int(epoch)])
            p = rng.permutation(len(self.data))
            if self.group_steps > 0:
                per = self.batch_size * self.grad_accum
                p = p[:self.steps_per_epoch * per]
                lens = self.data.lengths
                out = []
                for w0 in range(0, len(p), self.group_steps * per):
                    win = p[w0:w0 + self.group_steps * per]
                    win = win[np.argsort(lens[win], kind="stable")]
                    steps = win.reshape(-1, per)
                    out.append(steps[rng.permutation(len(steps))].reshape(-1))
                p = np.concatenate(out)
            self._perm_cache = {epoch: p}
        return p

    def rows(self, step: int) -> np.ndarray:
        """[grad_accum, batch_size] sequence indices of optimizer step `step` (0-based)."""
        epoch, j = self.position(step)
        per = self.batch_size * self.grad_accum
        return self._perm(epoch)[j * per:(j + 1) * per].reshape(self.grad_accum, self.batch_size)

    def batch(self, step: int) -> dict:
        """Stacked host arrays [grad_accum, batch_size, ...] of step `step`."""
        rows = self.rows(step)
        epoch, _ = self.position(step)
        T = bucket_for(int(self.data.lengths[rows.reshape(-1)].max()), self.buckets)
        return stack_batches([build_batch(self.data, r, T, self.num_anchors, self.seed, epoch) for r in rows])


def eval_batches(data: SequenceData, batch_size: int, num_anchors: int, seed: int, buckets, multiple: int = 1):
    """Fixed evaluation micro-batches over all of `data` (rows padded with -1 to `batch_size`)."""
    bs = int(math.ceil(batch_size / multiple) * multiple)
    out = []
    order = np.argsort(data.lengths, kind="stable")  # similar lengths together: less padding
    for s in range(0, len(data), bs):
        rows = order[s:s + bs].tolist()
        T = bucket_for(int(data.lengths[rows].max()), buckets)
        rows = rows + [-1] * (bs - len(rows))
        out.append(build_batch(data, rows, T, num_anchors, seed, EVAL_EPOCH))
    return out
