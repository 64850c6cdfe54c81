"""Shared pytest fixtures (kept small and generic; helpers live in tests/hf_utils.py)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# The suite runs on CPU. With libtpu installed (the [plan] extra, for tests/test_plan.py), JAX would
# otherwise probe for a TPU in every process (~1 s, warnings on stderr, libtpu's lock file); the
# planner compiles for TPU topologies under JAX_PLATFORMS=cpu all the same. Subprocesses inherit it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No persistent XLA compilation cache in the suite: sharing every program between the workers and subprocesses
# through one did not shorten it on 2 cores (1812 s against 1800 s without, one run each).

# XLA:CPU compiles with LLVM's optimisation off in the suite (and its subprocesses): the suite is compile-bound on
# 2 cores (tiny models, many programs), and this cuts compile-heavy tests by ~20% (test_lossless + test_engine:
# 85 -> 70 s). The programs' semantics are the same; every comparison in the suite is between runs compiled alike
# or against references with tolerances. Set XLA_FLAGS yourself to run the suite at the default level.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# Every XLA:CPU executable keeps ~6 memory mappings (its JIT code and data) while it lives, and an xdist worker that
# lives through half the suite compiles thousands of programs: past the kernel's vm.max_map_count (65530 by default)
# the next mmap fails and XLA crashes the worker with a segmentation fault inside a compile or an executable's
# serialization (a worker held 49,699 mappings 27 minutes into a suite run, after the other one had crashed so; a
# process compiling small programs under vm.max_map_count=2500 crashes the same way). After a test that leaves the
# worker holding more than half the limit, the compiled programs are dropped (jax's caches and generate()'s); later
# tests compile what they need again.
def map_count_limit() -> int:
    """The kernel's vm.max_map_count (its default where /proc does not say)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


MAX_MAPPINGS = map_count_limit() // 2


def mappings() -> int:
    """Memory mappings of this process (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if mappings() > MAX_MAPPINGS:
        import gc

        import jax

        import dflash_jax
        jax.clear_caches()
        dflash_jax.clear_compile_cache()
        gc.collect()


# The automatic shape's cost curves and acceptance evidence (dflash_jax.auto.store) go to a temp dir too,
# never to the user's ~/.cache/dflash_jax (tests that look at them set their own dir).
if "DFLASH_JAX_CACHE" not in os.environ:
    os.environ["DFLASH_JAX_CACHE"] = tempfile.mkdtemp(prefix="dflash-jax-tests-shapes-")
    os.environ["DFLASH_JAX_TEST_SHAPES_OWNER"] = str(os.getpid())


@atexit.register
def _remove_shape_cache():
    if os.environ.get("DFLASH_JAX_TEST_SHAPES_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["DFLASH_JAX_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Session cache of tiny random HF models saved to disk.

    `hf_models(family, **overrides) -> (path, torch_model)`; the same arguments return the same
    saved directory and module (built once), so treat both as read-only: copy the directory before
    editing files in it."""
    from tests.hf_utils import make_hf_model

    root = tmp_path_factory.mktemp("hf_models")
    cache: dict = {}

    def get(family: str = "qwen3", **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_hf_model(root, family, name=f"m{len(cache)}_{family}", **overrides)
        return cache[key]

    return get


# Files with the longest tests first, so that under xdist (--dist loadfile) they start early and
# the shorter files fill the other workers instead of one worker finishing alone (worker-seconds per file from
# `pytest --durations=0`, largest first; the multi-device and multi-process files spawn subprocesses).
_HEAVY_FIRST = ("test_hybrid.py", "test_sharding.py", "test_plan_programs.py", "test_moe.py", "test_plan.py",
                "test_gemma4.py", "test_cli_bench.py", "test_train_e2e.py", "test_drafter2.py", "test_reference.py",
                "test_quant.py", "test_serve.py", "test_bench_serve.py", "test_cli.py", "test_lossless.py",
                "test_serve_multihost.py", "test_engine.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return _HEAVY_FIRST.index(name) if name in _HEAVY_FIRST else len(_HEAVY_FIRST)
    items.sort(key=rank)  # stable: the order within a file is kept
