"""Compiled decode programs, kept per static shape, and the row-layout copies of the latest model pair.

A `ProgramCache` holds what a process compiled: one executable per (program kind, statics, mesh, attention
choice, argument shapes / dtypes / shardings), and, where the CPU row layout pays (programs.rows_pay), the
transposed copies of the latest (target, drafter) pair. generate() uses `DEFAULT`; its `counts` (compilations
per kind) is `dflash_jax.COMPILE_COUNTS`, which tests read to count compilations.
"""
from __future__ import annotations

import time

import jax

from .programs import program, rows_layout, rows_pay


class ProgramCache:
    def __init__(self):
        self.programs: dict = {}  # key -> compiled executable
        self.counts: dict = {"prefill": 0, "loop": 0}  # compilations per kind (never reset: a running count)
        self._rows: list = []  # [(target params, drafter params, row-layout target, row-layout drafter)]

    def compiled(self, kind: str, fn, statics: dict, args, donate=(), mesh=None, specs=None):
        """(executable, seconds spent compiling it now): `fn` with `statics` bound, compiled once for these
        argument shapes and kept. With a mesh, `fn` runs under shard_map with `specs` = (in_specs, out_specs)."""
        from ..attention import program_key
        key = (kind, tuple(sorted(statics.items())), mesh, program_key(),
               jax.tree_util.tree_structure(args),
               tuple((a.shape, str(a.dtype), getattr(a, "sharding", None)) for a in jax.tree_util.tree_leaves(args)))
        hit = self.programs.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        exe = program(fn, statics, donate, mesh, specs).lower(*args).compile()
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.programs[key] = exe
        return exe, time.perf_counter() - t0

    def rows_pair(self, target, drafter, width: int, mesh=None):
        """The models a decode runs: where `rows_pay` (and without a mesh), the by_rows copies made once per pair
        of weights and kept for the latest pair, so the decode loop finds them transposed already instead of
        transposing every call (~45 ms a call for the embedded pair, 5-10% of a short answer's decode)."""
        if mesh is not None or not rows_pay(target, drafter, width):
            return target, drafter
        for tp_, dp_, rt, rd in self._rows:
            if tp_ is target.params and dp_ is drafter.params:
                return rt, rd
        rt, rd = rows_layout(target, drafter, width)
        self._rows[:] = [(target.params, drafter.params, rt, rd)]
        return rt, rd

    @property
    def rows(self) -> list:
        """[(target params, drafter params, row-layout target, row-layout drafter)]: the latest pair's copies."""
        return list(self._rows)

    def clear(self) -> None:
        """Drop every executable and the row-layout copies (the counts go on)."""
        self.programs.clear()
        self._rows.clear()


DEFAULT = ProgramCache()
COMPILE_COUNTS = DEFAULT.counts


def clear_compile_cache() -> None:
    DEFAULT.clear()
