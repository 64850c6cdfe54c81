"""AdamW with warmup + cosine/linear/constant schedule and global-norm clipping (optax)."""
from __future__ import annotations

import jax
import optax

from .config import OptimizerSection


def make_schedule(o: OptimizerSection, total_steps: int):
    warmup = int(round(o.warmup_ratio * total_steps))
    peak, end = o.lr, o.lr * o.final_lr_ratio
    decay_steps = max(total_steps - warmup, 1)
    if o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=o.final_lr_ratio)
    elif o.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    # warmup reaches the peak at step `warmup` (step 0 trains at peak / (warmup + 1), never at 0)
    warm = optax.linear_schedule(peak / (warmup + 1), peak, warmup)
    return optax.join_schedules([warm, decay], [warmup])


def make_optimizer(o: OptimizerSection, total_steps: int, params=None):
    """(optax transformation, schedule fn)."""
    sched = make_schedule(o, total_steps)
    parts = []
    if o.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    parts.append(optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                             mask=decay_mask))
    return optax.chain(*parts), sched


def decay_mask(params):
    """Weight decay on matrices only: not on norm weights or biases."""
    # Params are stacked on a leading layer axis: a norm weight is [L, H] (2-D) in layers, [H] at top level.
    def is_matrix(path, a):
        names = [getattr(k, "key", getattr(k, "name", "")) for k in path]
        if any("norm" in str(n) or "bias" in str(n) for n in names):
            return False
        return a.ndim >= 2
    return jax.tree_util.tree_map_with_path(is_matrix, params)
