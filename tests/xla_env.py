"""XLA_FLAGS for the suite's subprocesses."""
from __future__ import annotations

import os


def subprocess_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test's subprocess: the suite's own (tests/conftest.py: LLVM optimisation off, the suite is
    compile-bound) without any device count, plus `devices` fake CPU devices when given."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))
