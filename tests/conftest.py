"""Shared pytest fixtures (kept small and generic; helpers live in tests/hf_utils.py)."""
from __future__ import annotations

import os

import pytest

# The suite runs on CPU. With libtpu installed (the [plan] extra, for tests/test_plan.py), JAX would
# otherwise probe for a TPU in every process (~1 s, warnings on stderr, libtpu's lock file); the
# planner compiles for TPU topologies under JAX_PLATFORMS=cpu all the same. Subprocesses inherit it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
