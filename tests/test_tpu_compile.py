"""Every program generate() and the serving engine build compiles for a TPU (ahead of time, as the planner compiles
them): at Qwen3-8B's layer widths (two target layers, one drafter layer), one row and 32 rows per chip, caches of
8,192 and 32,768 slots, prefill chunks at their largest size, on a v5p and a v6e topology. A Pallas kernel whose
VMEM overflows the compiler's scoped limit fails the whole program at compile time (on a TPU VM: generate() or the
server failing on a long prompt or a full batch); each kernel's applies(...) rule must decline such shapes
(dflash_jax.vmem).

Per case: generate()'s chunked prefill and the engine's (a quarter of the slots, chunked), whose kernels see a
chunk's 2,048 tokens per row. The decode programs (target-only step, B=16 cycle, 16-node tree cycle, the engine's
B=16 call) at one cache length per row count: the kernels' tiles, and so their VMEM, do not depend on the cache
length (KV blocks of 512 slots at both; checked below), only the programs' HBM does. The engine's calls of other
shapes run the same cycle functions (decode.programs) as generate()'s, whose kernels see the same tokens per row."""
from __future__ import annotations

import json
import os

import pytest

from dflash_jax.decode.state import PREFILL_CHUNK
from dflash_jax.planner.decode import DecodePrograms, DecodeSetup, load_target_config, make_drafter_config
from dflash_jax.planner.hlo import as_on_tpu, compile_program
from dflash_jax.planner.topology import make_mesh, resolve_tpu, topology_devices
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


DECODE_AT = {1: 32768, 32: 8192}  # rows per chip -> the cache its decode programs are compiled at


@as_on_tpu
def compile_errors(dec: DecodePrograms, rows: int, cache: int) -> dict:
    """{program: the compiler's error} of the case's programs (none: all compiled)."""
    programs = {"prefill": dec.args("prefill", 16, "stacked"), "engine_prefill": dec.engine_args("engine_prefill", 16)}
    if DECODE_AT[rows] == cache:
        programs.update({"target_step": dec.args("cycle", 1, "stacked"), "cycle 16": dec.args("cycle", 16, "stacked"),
                         "tree 16": dec.args("cycle", 16, "stacked", tree=16),
                         "engine_decode 16": dec.engine_args("engine_decode", 16)})
    out = {}
    for name, (fn, args) in programs.items():
        r = compile_program(fn, args)
        if not r["fits"]:  # two layers fit every chip: anything else is an error
            out[name] = r["error"]
    return out


@needs_libtpu
@pytest.mark.parametrize("tpu", ["v5p-8", "v6e-8"])
def test_every_decode_and_engine_program_compiles_for_tpu(qwen3_8b_two_layers, tpu):
    sl = resolve_tpu(tpu)
    mesh = make_mesh(topology_devices(sl), sl.chips, 1)
    tcfg = load_target_config(qwen3_8b_two_layers)
    dcfg = make_drafter_config(tcfg, None, 1, 16)
    errors = {}
    for rows, cache in CASES:
        P = cache - 512
        assert P > PREFILL_CHUNK  # the chunk loop at its full chunk size
        dec = DecodePrograms(DecodeSetup(tcfg, dcfg, mesh, rows * sl.chips, P, 256, cache))
        for name, err in compile_errors(dec, rows, cache).items():
            errors[f"{rows} rows per chip, cache {cache}: {name}"] = err
    assert not errors, errors


def test_the_attention_kernels_tiles_do_not_depend_on_the_cache_length():
    """Why the decode programs are compiled at one cache length per row count above: at Qwen3-8B's heads (4 query
    heads per KV head, D = 128) the attention kernel's tiles for a verify, a tree and a prefill chunk are the same at
    caches of 8,192 and 32,768 slots (the other kernels do not see the cache)."""
    from dflash_jax import kernels
    for n_new in (1, 16, 17, 2048):  # a step, a B=16 verify, a 16-node tree with its root, a prefill chunk
        assert len({kernels.tiling(4 * n_new, S, 128, n_new=n_new) for S in (8192, 32768)}) == 1, n_new
