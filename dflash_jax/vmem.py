"""The on-chip vector memory (VMEM) of the TPU a program is built for: what each Pallas kernel's `applies(...)` rule
and its `vmem_limit_bytes` are sized against.

A kernel whose blocks, scratch buffers and temporaries exceed the compiler's scoped VMEM limit does not compile
(`RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom`), and a program that takes it then fails as a whole: on a TPU VM
that is `generate()` or the server failing at compile time. So every kernel estimates its VMEM bytes for the shapes it
is handed, declines the shapes whose estimate exceeds `budget()` (the program then takes the XLA path) and asks the
compiler for `limit(estimate)` bytes of scoped VMEM (the default limit is 16 MiB).

Per TensorCore, as the TPU compiler reports it ("Used 66.34M of 63.94M" on a v5p core; checked by compiling a kernel
with a growing scratch buffer for each topology): v5p 64 MiB, v5e and v6e 128 MiB. The generation is the local TPU's
on a TPU host, the planner's topology while `building_for(...)` is active (compiling for a slice from a CPU host), else
the smallest (v5p's), which is safe everywhere.
"""
from __future__ import annotations

import contextlib

MiB = 1 << 20
CAPACITY = {"v5p": 64 * MiB, "v5e": 128 * MiB, "v6e": 128 * MiB}
SMALLEST = "v5p"
DEFAULT_LIMIT = 32 * MiB  # the least a kernel asks for (the compiler's own default is 16 MiB)
BUDGET_FRACTION = 11 / 16  # of the capacity, for a kernel's estimate: 44 MiB on v5p, 88 MiB on v5e / v6e
LIMIT_FRACTION = 7 / 8  # the most a kernel asks the compiler for (the rest: the compiler's own scratch)

_building: dict = {"generation": None}


def generation_of(device_kind: str) -> str:
    """'v5p' / 'v5e' / 'v6e' of a TPU device's `device_kind` ("TPU v5", "TPU v5p", "TPU v5 lite", "TPU v5e",
    "TPU v6 lite", "TPU v6e", ...); the smallest generation for one not known."""
    k = device_kind.lower().replace("tpu", "").strip()
    if k.startswith("v6"):
        return "v6e"
    if k.startswith("v5") and ("lite" in k or k.startswith("v5e")):
        return "v5e"
    if k.startswith("v5"):
        return "v5p"
    return SMALLEST


def generation() -> str:
    """The TPU generation programs are being built for now (see the module docstring)."""
    if _building["generation"]:
        return _building["generation"]
    import jax
    if jax.default_backend() == "tpu":
        return generation_of(jax.devices()[0].device_kind)
    return SMALLEST


@contextlib.contextmanager
def building_for(gen: str):
    """Size kernels for TPU generation `gen` ('v5p', 'v5e', 'v6e') while tracing: the planner compiling for a slice."""
    if gen not in CAPACITY:
        raise ValueError(f"unknown TPU generation {gen!r}; known: {sorted(CAPACITY)}")
    old = _building["generation"]
    _building["generation"] = gen
    try:
        yield
    finally:
        _building["generation"] = old


def capacity(gen: str | None = None) -> int:
    """VMEM bytes per TensorCore of `gen` (None: generation())."""
    return CAPACITY[gen or generation()]


def budget(gen: str | None = None) -> int:
    """The most VMEM bytes a kernel's own estimate may reach on `gen` for the kernel to apply."""
    return int(capacity(gen) * BUDGET_FRACTION)


def limit(estimate: int, gen: str | None = None) -> int:
    """The scoped VMEM limit to compile a kernel with, given its estimate (within budget()): a quarter above it, at
    least DEFAULT_LIMIT, at most LIMIT_FRACTION of the capacity."""
    return int(min(capacity(gen) * LIMIT_FRACTION, max(DEFAULT_LIMIT, estimate * 1.25)))
