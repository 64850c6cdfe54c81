"""Tensor/data-parallel decoding on 8 fake CPU devices equals the single-device run."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.xla_env import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = subprocess_xla_flags()  # the workers add their device count
    env.update(env_extra or {})
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _worker_result(tmp_path_factory, *mode):
    """Run tests/sharding_worker.py (8 fake devices) in `mode` and return its RESULT JSON."""
    p = _run([os.path.join(ROOT, "tests", "sharding_worker.py"), str(tmp_path_factory.mktemp("shard")), *mode])
    assert p.returncode == 0, p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    return _worker_result(tmp_path_factory)


def test_eight_devices(worker):
    assert worker["devices"] == 8


@pytest.mark.parametrize("case", ["(1, 8)/t1", "(2, 4)/greedy", "(4, 2)/topk", "(8, 1)/greedy"])
def test_sharded_equals_single_device(worker, case):
    r = worker["meshes"][case]
    assert r["target_only_equal"], "target-only decode differs from the single-device run"
    assert r["spec_equal"], "speculative decode differs from the single-device run"
    assert r["acceptance_equal"]
    assert r["spec_equals_target_only"]


@pytest.fixture(scope="module")
def tree_worker(tmp_path_factory):
    return _worker_result(tmp_path_factory, "tree")["tree"]


@pytest.fixture(scope="module")
def pallas_worker(tmp_path_factory):
    return _worker_result(tmp_path_factory, "pallas")["pallas"]


@pytest.mark.parametrize("case", ["(2, 4)/greedy", "(1, 8)/t1"])
def test_sharded_pallas_path_equals_single_device(pallas_worker, case):
    """The Pallas cache kernel (the TPU default, interpreted here) under shard_map: target-only and
    speculative decoding equal the single-device blockwise runs; acceptance lengths equal too."""
    r = pallas_worker[case]
    assert r["target_only_equal"] and r["spec_equals_target_only"] and r["acceptance_equal"], r


def test_sharded_tree_verification(tree_worker):
    """Tree verification under shard_map (tensor-parallel top-K over vocab shards, rows over 'data')
    equals target-only decoding; greedy acceptance equals the single-device tree run."""
    g, t1 = tree_worker["(1, 8)/greedy"], tree_worker["(2, 4)/t1"]
    assert g["spec_equals_target_only"] and g["acceptance_equal"], g
    assert t1["spec_equals_target_only"], t1


def test_sharded_shadow_trees_equal_single_device(tree_worker):
    """A chain's shadow trees (built unverified each cycle, vocab-parallel top-K) report the same commits under
    shard_map as on one device."""
    r = tree_worker["shadow"]
    assert r["equal"] and r["known"] >= r["cycles"] // 2, r


def test_sharded_shape_change_in_place(tree_worker):
    """A call that changes shape in place under shard_map (auto's look then the rest, generate._decode):
    chain -> tree, chain -> target-only, tree -> chain; the output equals target-only decoding."""
    sw = tree_worker["switch"]
    assert len(sw) == 3
    for case, r in sw.items():
        assert r["switched"] and r["spec_equals_target_only"], (case, r)


def test_sharded_loading_places_slices(worker):
    ld = worker["load"]
    assert ld["q_spec"] == [None, "model", None]  # q / k / v are stored [out, in] (layers.OUT_IN)
    assert ld["q_global_shape"] == [3, 128, 32] and ld["q_shard_shape"] == [3, 32, 32]
    assert ld["k_global_shape"] == [3, 64, 32]  # 2 KV heads x 16 replicated twice for model axis 4
    assert ld["embed_shard_shape"] == [16, 32]  # vocab-parallel embedding
    assert ld["tokens_equal"]
    assert ld["unrolled_q_shard_shape"] == [32, 32] and ld["unrolled_tokens_equal"]
    assert ld["resave_exact"]


def test_indivisible_kv_heads_error(worker):
    assert worker["bad_kv_error"] and "num_key_value_heads=3" in worker["bad_kv_error"]


def test_collectives_of_fused_step(worker):
    """The design: per scanned layer body 2 psums (o_proj, down_proj) for the target and 2 for the drafter,
    one psum per embedding lookup (target verify, drafter block), pmax+pmin per vocab-parallel argmax
    (drafts, verification), one pmax over 'data' for the loop condition = 11 all-reduces, no gathers.
    Every all-reduce is activation-sized (batch-local rows x block x hidden), never weight-sized."""
    loop = worker["collectives"]["loop"]
    assert loop["all-gather"] == [] and loop["all-to-all"] == [] and loop["reduce-scatter"] == []
    assert len(loop["all-reduce"]) == 11, loop
    assert max(loop["all-reduce"]) <= 1 * 4 * 32  # local rows (1) x block (4) x hidden (32)
    pre = worker["collectives"]["prefill"]
    assert pre["all-gather"] == []
    # prefill: 2 per target layer body + embedding + first-token argmax (2)
    assert len(pre["all-reduce"]) == 5, pre


MULTIHOST = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    from dflash_jax.distributed import initialize
    initialize(sys.argv[1], 2, int(sys.argv[2]))
    import jax, dflash_jax as dj
    from dflash_jax.sharding import make_mesh
    cfg = dj.TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    t = dj.init_target(cfg, seed=0, std=0.25)
    d = dj.init_drafter(t, num_layers=1, block_size=4, mask_token_id=63, seed=1, std=0.1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]
    mesh = make_mesh(2, 2) if len(sys.argv) > 3 else None
    r = dj.generate(t, d, prompts, max_new_tokens=10, stop_token_ids=[], mesh=mesh, block_size=None)
    print("RESULT " + json.dumps({"pid": jax.process_index(), "n": jax.device_count(), "tokens": r.tokens}))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_distributed(tmp_path):
    script = tmp_path / "mh.py"
    script.write_text(MULTIHOST)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = subprocess_xla_flags()  # the workers add their device count
    addr = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), addr, str(i), "mesh"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    results = [json.loads([l for l in so.splitlines() if l.startswith("RESULT ")][-1][7:]) for so, _ in outs]
    assert [r["n"] for r in results] == [4, 4]
    # single process reference (no distributed, one device)
    single = _run(["-c", MULTIHOST.replace("initialize(sys.argv[1], 2, int(sys.argv[2]))", "")])
    assert single.returncode == 0, single.stderr[-3000:]
    ref = json.loads([l for l in single.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert results[0]["tokens"] == results[1]["tokens"] == ref["tokens"]
