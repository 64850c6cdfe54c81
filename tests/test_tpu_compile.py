"""Every program generate() and the serving engine build compiles for a TPU (ahead of time, as the planner compiles
them): at Qwen3-8B's layer widths, one row and 32 rows per chip, caches of 8,192 and 32,768 slots, prefill chunks
at their largest size, on a v5p and a v6e topology. A Pallas kernel whose VMEM overflows the compiler's scoped
limit fails the whole program at compile time (on a TPU VM: generate() or the server failing on a long prompt or a
full batch); each kernel's applies(...) rule must decline such shapes (dflash_jax.vmem)."""
from __future__ import annotations

import json
import os

import pytest

from dflash_jax import planner as pl
from dflash_jax.decode.state import PREFILL_CHUNK
from tests.test_plan import ROOT, needs_libtpu

CASES = [(1, 8192), (1, 32768), (32, 8192), (32, 32768)]  # (rows per chip, cache slots)


@pytest.fixture(scope="module")
def qwen3_8b_two_layers(tmp_path_factory):
    with open(os.path.join(ROOT, "configs", "models", "qwen3-8b", "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2
    d = tmp_path_factory.mktemp("qwen3_8b_2l")
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(d)


@needs_libtpu
@pytest.mark.parametrize("tpu", ["v5p-8", "v6e-8"])
def test_every_decode_and_engine_program_compiles_for_tpu(qwen3_8b_two_layers, tpu):
    chips = pl.resolve_tpu(tpu).chips
    for rows, cache in CASES:
        P = cache - 512  # longer than a prefill chunk: the chunk loop at its full chunk size
        rep = pl.plan(qwen3_8b_two_layers, tpu, drafter_layers=1, block_sizes=(4, 16), batch=rows * chips,
                      prompt_len=P, max_new_tokens=256, cache_len=cache, tree_budgets=(16,) if rows > 1 else (),
                      cost=False, largest_batch=False, engine=True)
        names = [(p["name"], p.get("block_size"), p.get("tree_budget")) for p in rep["programs"]]
        assert ("prefill", 16, None) in names and ("target_step", 1, None) in names and ("cycle", 16, None) in names
        assert ("engine_prefill", 16, None) in names and ("engine_decode", 1, None) in names
        assert (rows == 1) or ("tree_cycle", 16, 16) in names and ("engine_decode", 16, 16) in names
        assert P > PREFILL_CHUNK
        assert not pl.compile_errors(rep), (tpu, rows, cache, pl.compile_errors(rep))
        for p in rep["programs"]:
            assert p["fits"], (tpu, rows, cache, p["name"], p.get("error"))  # two layers fit every chip
