"""Automatic shape choice: acceptance estimates from the full-block histogram, the choice maximising
expected tokens per unit time, the on-disk cost cache (a temp dir), and generate(block_size="auto")."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_jax import autoshape as au


def test_tau_from_full_block_histogram_and_tree_floor():
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[1, 3, 8, 2], [5]])  # committed per cycle at the full block
    n = np.array([1, 3, 8, 2, 5])
    for B in (2, 4, 8):
        assert ev.tau(au.Shape(B)) == pytest.approx(np.minimum(n, B).mean())
    # a tree of N nodes: floor = the chain to depth min(N, 7), + the bonus token
    assert ev.tau(au.Shape(8, 3)) == pytest.approx(np.minimum(n, 4).mean())
    assert ev.tau(au.Shape(8, 32)) == pytest.approx(n.mean())
    ev.add(au.Shape(8, 3), [[4, 4], [2]])  # observed: its own mean wins
    assert ev.tau(au.Shape(8, 3)) == pytest.approx(10 / 3)
    assert ev.tau(au.Shape(1)) == 1.0


def test_choice_maximises_tokens_per_time_and_includes_target_only():
    shapes = au.candidate_shapes(8, blocks=(2, 4, 8), trees=(4, 16))
    ev = au.Evidence(full_block=8)
    first = au.choose(shapes, {}, ev)
    assert first.shape == au.Shape(8) and "no acceptance observed" in first.reason
    ev.add(au.Shape(8), [[3, 3, 4, 2, 3]])
    costs = {"target": 1.0, "B2": 1.2, "B4": 1.5, "B8": 2.5, "tree4": 2.0, "tree16": 4.0}
    c = au.choose(shapes, costs, ev)
    rates = {s: ev.tau(s) / costs[s.key] for s in shapes}
    assert c.shape == max(rates, key=rates.get) == au.Shape(4)
    assert "B=4" in c.reason and "\n" not in c.reason
    # nothing pays: target-only
    bad = {k: (v if k == "target" else 10.0) for k, v in costs.items()}
    assert au.choose(shapes, bad, ev).shape == au.Shape(1)
    # a tree never tried whose floor is close to the best is tried once, then judged on its own mean
    near = dict(costs, tree4=1.8)
    c = au.choose(shapes, near, ev, explore=0.8)
    assert c.shape == au.Shape(8, 4) and "trying" in c.reason
    ev.add(au.Shape(8, 4), [[5, 5, 5]])
    assert au.choose(shapes, near, ev).shape == au.Shape(8, 4)  # 5 / 1.8 beats 3 / 1.5


def _tiny_pair(tmp_path, monkeypatch):
    """A tiny random target + 4-block drafter, with the shape-cost cache in tmp_path."""
    import dflash_jax as dj
    from dflash_jax.config import TargetConfig
    monkeypatch.setenv(au.ENV_DIR, str(tmp_path))
    cfg = TargetConfig(family="qwen3", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, max_position_embeddings=512)
    target = dj.init_target(cfg, seed=1, std=0.6)
    return target, dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=15, seed=2, std=0.1,
                                   target_layer_ids=(0, 1))


def test_generate_auto_uses_disk_costs_and_stays_lossless(tmp_path, monkeypatch):
    import dflash_jax as dj
    target, drafter = _tiny_pair(tmp_path, monkeypatch)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    # costs measured earlier (the file is what a measurement writes): every drafted shape is dear
    shapes = au.candidate_shapes(4)
    from dflash_jax.generate import prompt_and_cache_len
    _, S = prompt_and_cache_len(5, 20, max(au.TREE_BUDGETS) + 1)  # generate()'s cache: widest candidate
    key = au.cost_key(target, drafter, 2, S)
    costs = {s.key: (1.0 if s.block == 1 else 50.0) for s in shapes}
    (tmp_path / "shape_costs.json").write_text(json.dumps({key: costs}))
    ref = dj.generate(target, None, prompts, max_new_tokens=20, max_cache_len=S)
    first = dj.generate(target, drafter, prompts, max_new_tokens=20, block_size="auto")
    assert first.tokens == ref.tokens and first.block_size == 4 and "no acceptance observed" in first.auto_reason
    second = dj.generate(target, drafter, prompts, max_new_tokens=20, block_size="auto")
    assert second.tokens == ref.tokens
    ev = au.evidence_for(target, drafter)
    rates = {s: ev.tau(s) / costs[s.key] for s in shapes if ev.tau(s) is not None}
    want = max(rates, key=rates.get)
    assert want == au.Shape(1) and second.block_size == 1  # no drafted shape pays at 50 target steps a cycle
    assert second.auto_reason.startswith("auto shape: target-only")
    assert json.loads((tmp_path / "shape_costs.json").read_text()) == {key: costs}  # nothing re-measured
    with pytest.raises(ValueError, match="auto"):
        dj.generate(target, drafter, prompts, max_new_tokens=4, block_size="auto", tree_budget=8)


def test_evidence_decays_so_the_choice_follows_the_text_and_target_only_probes():
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    costs = {"target": 1.0, "B4": 2.0, "B8": 2.5}
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[6] * 2000])  # easy text, a long run: B=8 pays (6 / 2.5)
    assert au.choose(shapes, costs, ev).shape == au.Shape(8)
    ev.add(au.Shape(8), [[1] * 4 * au.HALF_LIFE])  # then text where nothing is accepted, 4 half-lives
    assert ev.tau(au.Shape(8)) < 1.5  # the old text counts 1/16
    c = au.choose(shapes, costs, ev)
    assert c.shape == au.Shape(1)
    for _ in range(au.PROBE_EVERY - 1):
        ev.add(au.Shape(1), [[1]])
    probe = au.choose(shapes, costs, ev)
    assert probe.shape.block > 1 and "probing" in probe.reason
    ev.add(probe.shape, [[min(6, probe.shape.block)] * 4 * au.HALF_LIFE])  # the easy text is back
    assert au.choose(shapes, costs, ev).shape.block > 1


def test_cost_curve_fits_a_small_cache(tmp_path, monkeypatch):
    """Measuring in a cache barely wider than the widest shape shortens the runs instead of overflowing it."""
    target, drafter = _tiny_pair(tmp_path, monkeypatch)
    shapes = [au.Shape(1), au.Shape(4), au.Shape(4, 64)]
    costs = au.cost_curve(target, drafter, 1, 128, shapes, rounds=1)
    assert set(costs) == {"target", "B4", "tree64"} and costs["target"] == 1.0
    assert costs["tree64"] >= costs["B4"] > 0
    stored = json.loads((tmp_path / "shape_costs.json").read_text())
    assert stored[au.cost_key(target, drafter, 1, 128)] == costs
