"""dflash_jax.auto: the policy's choices on known acceptance and costs, its exploring, its clock, its knobs, the
store, and a one-seed replay on the recorded traces (infer.auto_replay)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dflash_jax.auto import AutoPolicy, Evidence, Shape, candidate_shapes, store

SHAPES = candidate_shapes(16)
FULL = Shape(16)
CURVE = {"B2": 1.2, "B4": 1.5, "B8": 2.5, "B16": 4.0, "tree3": 3.0, "tree7": 3.5, "tree15": 5.0, "tree31": 6.0,
         "tree63": 8.0}


def _feed(policy, ev, p, calls=40, cycles=30, seed=0):
    """Full-block calls whose drafts are each accepted with probability p (given the ones before)."""
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        row = []
        for _ in range(cycles):
            k = 0
            while k < 15 and rng.random() < p:
                k += 1
            row.append(k + 1)
        policy.record(ev, SHAPES, CURVE, FULL, [row], [row])


def _rate(p, shape):
    return (1 + sum(p ** k for k in range(1, shape.block))) / CURVE[shape.key]


def test_picks_the_best_shape_when_acceptance_is_known():
    policy = AutoPolicy(horizon=0)
    ev = Evidence(full_block=16)
    _feed(policy, ev, 0.7)
    c = policy.choose(ev, SHAPES, CURVE)
    chains = [s for s in SHAPES if s.block > 1 and not s.tree]
    best = max(chains, key=lambda s: _rate(0.7, s))
    assert best == Shape(4) and c.shape == best and not c.shape.tree
    assert c.expected_speedup == pytest.approx(_rate(0.7, best), rel=0.1)
    assert c.look  # a drafted call decides its rest after its look
    assert "B=4" in c.reason and "\n" not in c.reason
    rest = policy.choose(ev, SHAPES, CURVE, rest=True)  # the rest of a call: at its answer's level, no look
    assert not rest.look


def test_target_only_when_drafting_does_not_pay():
    policy = AutoPolicy(horizon=0)
    ev = Evidence(full_block=16)
    _feed(policy, ev, 0.15)  # a chain of 2 commits ~1.15 tokens a cycle at 1.2 target steps
    c = policy.choose(ev, SHAPES, CURVE)
    assert c.shape == Shape(1) and c.expected_speedup == 1.0 and not c.look


def test_first_call_looks_at_the_full_block():
    c = AutoPolicy().choose(Evidence(full_block=16), SHAPES, CURVE)
    assert c.shape == FULL and c.look


def test_explores_when_a_look_pays_and_never_with_horizon_zero():
    """Drafting was seen not to pay; with target-only running, the text's level becomes uncertain again (text_sd a
    call) and a look at the best drafted shape comes to be worth its cost."""
    for horizon, want in ((4.0, True), (0.0, False)):
        policy = AutoPolicy(horizon=horizon, text_sd=0.3)
        ev = Evidence(full_block=16)
        _feed(policy, ev, 0.55, calls=10)
        explored = False
        for _ in range(60):
            c = policy.choose(ev, SHAPES, CURVE)
            if c.shape.block > 1:
                explored = explored or "exploring" in c.reason
                break
            policy.record(ev, SHAPES, CURVE, Shape(1), [[1] * 30])
        assert explored == want


def test_tree_gain_from_shadows_and_the_full_block_to_measure_it():
    policy = AutoPolicy(horizon=0)
    ev = Evidence(full_block=16)
    assert policy.shadow_trees(ev, Shape(8), SHAPES) == (3, 7)
    assert policy.shadow_trees(ev, FULL, SHAPES) == (3, 7, 15, 31, 63)
    assert policy.shadow_trees(ev, Shape(1), SHAPES) == () == policy.shadow_trees(ev, Shape(16, 7), SHAPES)
    # a chain whose cycles commit 2 where tree 7 would have committed 4: the tree's gain is 2
    for _ in range(20):
        policy.record(ev, SHAPES, CURVE, Shape(8), [[2] * 40], shadows={3: [[3] * 40], 7: [[4] * 40]})
    t, c, n = ev.gain["tree7"]
    assert t / c == pytest.approx(2.0) and n > policy.shadow_cycles
    assert policy.shadow_trees(ev, Shape(8), SHAPES) == ()  # measured: no more shadows needed
    tau = dict(zip(SHAPES, policy.taus(ev, SHAPES, policy._level(ev, False))[0]))
    assert tau[Shape(16, 7)] == pytest.approx(2 * tau[Shape(8)], rel=0.05)
    assert tau[Shape(16, 15)] >= tau[Shape(16, 7)]  # a larger tree holds the smaller one


def test_a_chain_of_b_has_its_own_profile():
    """A chain of B < full drafts with its own block: its calls move its own profile, whose prior is the full block's
    (own_sd wider; a chain without evidence of its own follows the full block's, less sure of it)."""
    ev = Evidence(full_block=16)
    full, own = AutoPolicy().profile(ev, var=True), AutoPolicy().profile(ev, 8, var=True)
    assert np.allclose(own[0], full[0]) and np.allclose(own[1][:7], full[1][:7] + AutoPolicy().own_sd ** 2)
    for own_sd, gain in ((AutoPolicy().own_sd, 1.03), (1.0, 1.15)):
        policy, rng, ev = AutoPolicy(horizon=0, own_sd=own_sd), np.random.default_rng(0), Evidence(full_block=16)
        for i in range(60):  # the full block's drafts accepted with p 0.6, a chain of 8's own ones with p 0.8
            p, shape = (0.6, FULL) if i % 2 else (0.8, Shape(8))
            row = [1 + next(k for k in range(shape.block) if k == shape.block - 1 or rng.random() > p)
                   for _ in range(30)]
            policy.record(ev, SHAPES, CURVE, shape, [row], [row] if shape == FULL else None)
        alone = Evidence(**{**dataclasses.asdict(ev), "own": {}})  # without the chain of 8's own evidence
        tau, tau1 = (dict(zip(SHAPES, policy.taus(e, SHAPES, policy._level(e, False))[0])) for e in (ev, alone))
        assert tau[Shape(8)] > gain * tau1[Shape(8)]
        assert np.allclose(policy.profile(ev, 4)[:3], policy.profile(ev)[:3])  # no evidence of its own
    assert tau[Shape(8)] > tau[FULL]  # own blocks free to differ (own_sd 1): its own data decide


def test_a_shadow_the_answer_ended_in_counts_what_was_left():
    """Where the text ends inside a shadow tree's walk (0) and the row has ended, the tree would have committed
    what was left; in a look that goes on, it is unknown."""
    policy = AutoPolicy(horizon=0)
    ev = Evidence(full_block=16)
    policy.record(ev, SHAPES, CURVE, FULL, [[3, 2]], [[3, 2]], shadows={7: [[4, 0]]})  # a 6-token answer
    assert ev.gain["tree7"] == [4 + 2, 3 + 2, 2]
    ev = Evidence(full_block=16)
    policy.record(ev, SHAPES, CURVE, FULL, [[4] * 16], [[4] * 16], shadows={7: [[5] * 15 + [0]]})  # a look
    assert ev.gain["tree7"] == [75, 60, 15]


def test_tree_runs_inform_depth_one_only():
    policy = AutoPolicy()
    ev = Evidence(full_block=16)
    # the chain record of a tree run: censored at its greedy depth; only draft 1's outcome is taken
    policy.record(ev, SHAPES, CURVE, Shape(16, 7), [[3, 1, 4]], [[-4, 1, -5]])
    assert ev.depth[0][1] > 0 and all(lam == 0 for _, lam in ev.depth[1:])


def test_injected_clock():
    """Costs are fitted from timings against the step's random walk in `now`'s time: a drafted timing right after a
    step's moves the cost more than one taken an hour later (the step may have drifted since); nothing reads the
    wall clock."""
    import time
    moved = {}
    for gap in (0.0, 3600.0):
        policy, ev = AutoPolicy(), Evidence(full_block=16)
        policy.record(ev, SHAPES, CURVE, Shape(1), [[1] * 50], seconds=0.05, cycles=50, context="c", now=1000.0)
        real = time.time
        try:
            time.time = lambda: (_ for _ in ()).throw(AssertionError("the policy read the wall clock"))
            policy.record(ev, SHAPES, CURVE, Shape(4), [[2] * 50], seconds=0.05 * 1.2 * CURVE["B4"], cycles=50,
                          context="c", now=1000.0 + gap)
            policy.choose(ev, SHAPES, CURVE, context="c")
        finally:
            time.time = real
        moved[gap] = policy.costs(ev, SHAPES, CURVE, "c")[0][SHAPES.index(Shape(4))] / CURVE["B4"]
    assert moved[0.0] > moved[3600.0] > 1.0
    assert moved[0.0] == pytest.approx(1.2, rel=0.1)


@pytest.mark.parametrize("kw", [{"text_sd": 0}, {"answer_sd": -1}, {"memory": float("nan")}, {"horizon": -1},
                                {"look_tokens": "64"}, {"draws": True}, {"curve_sd": None}])
def test_bad_knobs_are_one_line_value_errors(kw):
    with pytest.raises(ValueError) as e:
        AutoPolicy(**kw)
    assert "\n" not in str(e.value) and next(iter(kw)) in str(e.value)


def test_choices_are_reproducible():
    policy = AutoPolicy()
    ev = Evidence(full_block=16)
    _feed(policy, ev, 0.6, calls=5)
    assert policy.choose(ev, SHAPES, CURVE) == policy.choose(ev, SHAPES, CURVE)


def test_store_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv(store.ENV_DIR, str(tmp_path))
    policy, ev = AutoPolicy(), Evidence(full_block=16)
    _feed(policy, ev, 0.6, calls=3)
    policy.record(ev, SHAPES, CURVE, Shape(4), [[2] * 5], seconds=0.1, cycles=5, context="b1|S1024", now=1.0)
    store.save_evidence("pair|cpu", ev)
    back = store.load_evidence("pair|cpu", 16)
    assert dataclasses.asdict(back) == json.loads(json.dumps(dataclasses.asdict(ev)))
    assert policy.choose(back, SHAPES, CURVE) == policy.choose(ev, SHAPES, CURVE)
    assert store.load_evidence("other", 16).calls == 0 and store.load_evidence("pair|cpu", 8).full_block == 8
    calls = []
    measure = lambda: calls.append(1) or dict(CURVE, target=1.0)
    keys = [s.key for s in SHAPES]
    assert store.cached_curve("k", keys, measure) == store.cached_curve("k", keys, measure) and len(calls) == 1
    table = json.loads((tmp_path / store.FILE).read_text())
    table["version"] = store.VERSION + 1  # another version: ignored
    (tmp_path / store.FILE).write_text(json.dumps(table))
    assert store.load_evidence("pair|cpu", 16).calls == 0
    store.cached_curve("k", keys, measure)
    assert len(calls) == 2
    c = policy.choose(ev, SHAPES, CURVE)
    assert store.agree(c, SHAPES) is c  # one process


def test_replay_smoke():
    """One seed of the maintained replay on the recorded traces: drafting pays on GSM8K at this CPU's recorded
    costs and auto finds most of it; on the v5p curve it settles on the best tree."""
    from infer import auto_replay as R
    traces, costs = R.load_traces(), R.load_costs()
    true = costs["cpu-2core-f"]["costs"]
    per_pass, _ = R.replay_seed(traces, true, 0, sets=("gsm8k",))["gsm8k"]
    best = max(R.expected_speedups(traces["gsm8k"], true).values())
    assert np.median(per_pass) > 1.1 and np.median(per_pass) / best > 0.85
    v5p = costs["v5p-qwen3-8b"]["costs"]
    _, steady = R.replay_seed(traces, v5p, 0, sets=("gsm8k",), curve_noise=0.0)["gsm8k"]
    exp = R.expected_speedups(traces["gsm8k"], v5p)
    assert exp[steady] >= 0.99 * max(exp.values())
