"""Automatic shape choice: acceptance estimates from the full-block histogram, the choice maximising
expected tokens per unit time, the on-disk cost cache (a temp dir), and generate(block_size="auto")."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from dflash_jax import autoshape as au


@pytest.fixture(autouse=True)
def _still_clock(monkeypatch):
    """Cycle times fade with wall-clock age (TIME_HALF_LIFE): the tests' clock stands still unless they move it."""
    clock = [1000.0]
    monkeypatch.setattr(au, "_now", lambda: clock[0])
    return clock


def _one_part(monkeypatch):
    """Every cycle in part 1 (none early, the look's part never ends)."""
    monkeypatch.setattr(au, "EARLY_TOKENS", 0)
    monkeypatch.setattr(au, "LOOK_TOKENS", 10 ** 6)


def test_tau_from_the_per_depth_model_censoring_and_tree_gain(monkeypatch):
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)  # the plain per-depth estimate, checked exactly
    _one_part(monkeypatch)
    ev = au.Evidence(full_block=8)
    assert ev.tau(au.Shape(4)) is None  # nothing observed
    ev.add(au.Shape(8), [[1, 3, 8, 2], [5]])  # committed per cycle at the full block: exact observations
    n = np.array([1, 3, 8, 2, 5])
    for B in (2, 4, 8):
        assert ev.tau(au.Shape(B)) == pytest.approx(np.minimum(n, B).mean())
    # a tree never run: the chain to depth min(N, 7), + the bonus token
    assert ev.tau(au.Shape(8, 3)) == pytest.approx(np.minimum(n, 4).mean())
    assert ev.tau(au.Shape(8, 32)) == pytest.approx(n.mean())
    assert ev.tau(au.Shape(1)) == 1.0

    # a shorter block's full commits are censored: they say nothing of the depths past the block
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(4), [[4, 4, 4, 1]])
    assert ev.accept_probs()[:3] == pytest.approx([0.75, 1.0, 1.0])
    assert ev.tau(au.Shape(4)) == pytest.approx(3.25)  # = mean(min(n, 4))
    # tree cycles feed the same model (what the full-block chain would have committed), and the tree's
    # own commits give its gain over that chain
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8, 16), [[5, 5, 4, 6]], chain_lengths=[[3, 3, 3, 3]])
    assert ev.tau(au.Shape(8)) == pytest.approx(3.0) and ev.tau(au.Shape(2)) == pytest.approx(2.0)
    assert ev.tau(au.Shape(8, 16)) == pytest.approx(5.0)  # its gain 20 / 12, times the chain's 3
    assert ev.tau(au.Shape(8, 32)) == pytest.approx(5.0)  # a larger tree never run: the smaller one's gain
    ev.add(au.Shape(8, 4), [[2, 2]], chain_lengths=[[-2, 1]])  # -2: the tree's greedy chain ended, >= 2
    keep = 0.5 ** (2 / au.HALF_LIFE + 1 / au.CALL_HALF_LIFE)  # the decay a 2-cycle call brings
    assert ev.risk[1][1] == pytest.approx(4 * keep + 2)
    assert ev.miss[1][1] == pytest.approx(1.0) and ev.miss[1][2] == 0.0
    # draft 3: the first call's rejections stand, undecayed - this call reached no draft past 1, so it says
    # nothing new there (a depth decays only with cycles that verified it)
    assert ev.miss[1][3] == pytest.approx(4.0) and ev.risk[1][3] == pytest.approx(4.0)
    # with the depth prior, a depth that few cycles reached leans on the one before it
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[4] * 40 + [5]])  # draft 4 rejected 40 times in 41, draft 5 once in 1
    assert ev.accept_probs()[4] == 0.0
    monkeypatch.setattr(au, "DEPTH_PRIOR", 4.0)
    p = ev.accept_probs()
    k = au.DEPTH_TREND
    want = [1.0]  # draft 1: no prior; then 4 pseudo-cycles at k x the depth before (no other part here)
    for passed, seen in ((41, 41), (41, 41), (1, 41), (0, 1), (0, 0), (0, 0)):
        want.append((passed + 4 * k * want[-1]) / (seen + 4))
    assert p == pytest.approx(want)
    assert p[4] == pytest.approx(k * p[3] * 4 / 5)  # one rejection in one: pulled up by the prior
    # ... or on the other part's estimate at that depth, where that part saw it in DEPTH_PRIOR cycles or more
    monkeypatch.setattr(au, "EARLY_TOKENS", 1000)  # now every cycle is early (part 0)
    ev.add(au.Shape(8), [[6] * 10])
    q = ev.accept_probs(0)
    assert ev.risk[1][5] < au.DEPTH_PRIOR  # part 1 saw draft 5 once: not enough, the depth before counts
    assert q[4] == pytest.approx((10 + 4 * k * q[3]) / (10 + 4))
    monkeypatch.setattr(au, "EARLY_TOKENS", 0)
    ev.add(au.Shape(8), [[5] * 6])  # part 1: draft 5 rejected in 6 more cycles
    monkeypatch.setattr(au, "EARLY_TOKENS", 1000)
    assert ev.risk[1][5] >= au.DEPTH_PRIOR
    q = ev.accept_probs(0)
    r0 = ev.risk[0][5]  # draft 5 passed in every part-0 cycle that reached it (10, decayed)
    assert q[4] == pytest.approx((r0 + 4 * 0.0) / (r0 + 4))  # part 1's estimate there: 0


def test_a_tree_runs_gain_is_paired_with_the_chain_in_its_own_cycles(monkeypatch):
    """A tree run's gain is its commits over what the full-block chain commits in the same cycles (the cycle's chain
    length, cut at the tree's depth; given only a lower bound, the model's expectation above it): an answer harder
    than the model's texts does not read as a tree worse than the chain."""
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)
    _one_part(monkeypatch)
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[6] * 100])  # easy text: the chain commits 6 a cycle
    ev.add(au.Shape(8, 7), [[2, 3, 2, 3]], chain_lengths=[[2, 2, 2, 2]])  # a hard answer: chain 2, the tree 2.5
    assert ev.tree_gain(au.Shape(8, 7)) == pytest.approx(10 / 8)  # against the model's ~6: 0.4
    # a censored cycle (the tree's greedy chain ended at 3: the chain commits at least 3) counts at the model's
    # expectation given that: 3 + P(draft 3 accepted | 1-2 were) + P(3 and 4 ...) + ..., up to the tree's depth
    p = ev.accept_probs()
    want = 3 + sum(np.prod(p[2:k]) for k in range(3, 8))
    assert au._chain_given(-3, 8, p) == pytest.approx(want)
    assert au._chain_given(5, 4, p) == 4.0 and au._chain_given(-6, 4, p) == 4.0 and au._chain_given(2, 8, p) == 2.0
    t = list(ev.trees["tree7"])
    ev.add(au.Shape(8, 7), [[4]], chain_lengths=[[-3]])
    keep = 0.5 ** (1 / au.HALF_LIFE + 1 / au.CALL_HALF_LIFE)
    assert ev.trees["tree7"][0] == pytest.approx(t[0] * keep + 4)
    assert ev.trees["tree7"][1] == pytest.approx(t[1] * keep + au._chain_given(-3, 8, ev.accept_probs()))


def test_shadow_trees_give_a_trees_gain_paired_with_the_chains_own_commits(monkeypatch):
    """A chain call's shadow trees (GenerationResult.shadow_lengths: what a tree would have committed at each
    cycle's anchor) give that tree's gain over the chain to its depth, against the chain's own commits there."""
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)  # the plain per-depth estimate, checked exactly
    _one_part(monkeypatch)
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[1, 3, 8, 2], [5]], shadows={3: [[2, 4, 0, 3], [4]], 7: [[2, 5, 8, 3], [6]]})
    n = np.array([1, 3, 8, 2, 5])
    # tree 3 vs the chain to depth 3 (min(n, 4)), the unknown (0) cycle left out: (2 + 4 + 3 + 4) / (1 + 3 + 2 + 4)
    assert ev.tree_gain(au.Shape(8, 3)) == pytest.approx(1.3) and ev.tree_cycles["tree3"] == 4
    assert ev.tau(au.Shape(8, 3)) == pytest.approx(np.minimum(n, 4).mean() * 1.3)
    assert ev.tree_gain(au.Shape(8, 7)) == pytest.approx(24 / 19) and ev.tree_cycles["tree7"] == 5
    before = copy.deepcopy(ev.trees)
    ev.add(au.Shape(8), [[2, 2]])  # a call without shadows leaves the trees' evidence as it was (no fading)
    assert ev.trees == before
    # a shorter chain: its whole-block commits (censored: -4) are the chain to tree 3's depth exactly
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(4), [[4, 2, 1]], shadows={3: [[4, 3, 1]]})
    assert ev.trees["tree3"] == [8.0, 7.0]
    # which trees a chain call shadows: the candidates no deeper than its drafts (any with the full block), costing
    # at most SHADOW_COST x its cycle; while one has less than TREE_TRY_CYCLES row-cycles, then every SHADOW_EVERY-th
    shapes = au.candidate_shapes(8)
    costs = {"target": 1.0, "B2": 1.5, "B4": 2.0, "B8": 3.0, "tree3": 3.0, "tree7": 4.0, "tree15": 5.0, "tree31": 7.0,
             "tree63": 12.0}
    ev = au.Evidence(full_block=8, drafted=1)
    assert au.shadow_trees(ev, au.Shape(4), shapes, costs) == (3,)
    assert au.shadow_trees(ev, au.Shape(8), shapes, costs) == (3, 7, 15)
    assert au.shadow_trees(ev, au.Shape(8, 7), shapes, costs) == () == au.shadow_trees(ev, au.Shape(1), shapes, costs)
    ev.tree_cycles = {"tree3": au.TREE_TRY_CYCLES, "tree7": au.TREE_TRY_CYCLES, "tree15": au.TREE_TRY_CYCLES}
    assert au.shadow_trees(ev, au.Shape(8), shapes, costs) == ()
    ev.drafted = au.SHADOW_EVERY
    assert au.shadow_trees(ev, au.Shape(8), shapes, costs) == (3, 7, 15)


def test_a_shadowed_trees_gain_comes_from_shadows_only(monkeypatch):
    """Once a chain call has shadowed a tree, that tree's gain is the shadows' alone: its runs' sums so far are dropped
    and later runs leave it as it is (they still count as its cycles run). A run pairs the tree with the chain at the
    tree's own anchors, where the chain's commit is often known only as a bound that the tree's greedy chain set - and
    it ends where the drafter is unsure, so the model's expectation past it reads the chain high and the gain low."""
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)
    _one_part(monkeypatch)
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[6] * 100])
    ev.add(au.Shape(8, 7), [[4, 4]], chain_lengths=[[-3, -3]])  # a run: censored at 3, paired at the model's ~5.3
    run_gain = ev.tree_gain(au.Shape(8, 7))
    assert run_gain < 0.8 and ev.tree_cycles["tree7"] == 2
    ev.add(au.Shape(8), [[3, 5, 8]], shadows={7: [[4, 6, 8]]})  # a chain call shadows tree 7: 18 against 16
    assert ev.tree_gain(au.Shape(8, 7)) == pytest.approx(18 / 16) and ev.shadowed == ["tree7"]
    before = list(ev.trees["tree7"])
    ev.add(au.Shape(8, 7), [[4, 4]], chain_lengths=[[-3, -3]])  # its runs no longer move it, nor fade it
    assert ev.trees["tree7"] == before and ev.tree_cycles["tree7"] == 2 + 3 + 2
    ev2 = au.Evidence(full_block=8)  # a tree no chain call shadowed: its runs measure it (paired, as before)
    ev2.add(au.Shape(8), [[6] * 100])
    ev2.add(au.Shape(8, 7), [[4, 4]], chain_lengths=[[-3, -3]])
    ev2.add(au.Shape(8, 7), [[4, 4]], chain_lengths=[[-3, -3]])
    assert ev2.tree_gain(au.Shape(8, 7)) == pytest.approx(run_gain, rel=0.05) and not ev2.shadowed


def test_choice_maximises_tokens_per_time_and_includes_target_only(monkeypatch):
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)  # estimates = the plain empirical ones of these few cycles
    monkeypatch.setattr(au, "EARLY_TOKENS", 0)
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
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
    monkeypatch.setattr(au, "MIN_EVIDENCE", 3)  # ... but not before 3 drafted calls (one seen): the best drafted
    c = au.choose(shapes, bad, ev)
    assert c.shape.block > 1 and "1 drafted calls seen" in c.reason
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    # a tree never tried whose floor is close to the best is tried (looks) until it ran TREE_TRY_CYCLES row-cycles,
    # then judged on its gain
    near = dict(costs, tree4=1.8)
    c = au.choose(shapes, near, ev, explore=0.8)
    assert c.shape == au.Shape(8, 4) and "trying" in c.reason and c.look
    ev.add(au.Shape(8, 4), [[5, 5, 5]], chain_lengths=[[3, 3, 3]])  # the chain would have committed 3 a cycle
    assert ev.tau(au.Shape(8, 4)) == pytest.approx(5.0)
    c = au.choose(shapes, near, ev)
    assert c.shape == au.Shape(8, 4) and "trying" in c.reason and c.look  # 3 cycles say little: another look
    n = au.TREE_TRY_CYCLES - 3
    ev.add(au.Shape(8, 4), [[5] * n], chain_lengths=[[3] * n])
    c = au.choose(shapes, near, ev)
    assert c.shape == au.Shape(8, 4) and not c.look and "expected" in c.reason  # 5 / 1.8 beats 3 / 1.5
    assert au.choose(shapes, costs, ev).shape == au.Shape(8, 4)  # at its curve cost too (5 / 2.0)


def _tiny_pair(tmp_path, monkeypatch):
    """A tiny random target + 4-block drafter, with the shape-cost cache in tmp_path."""
    import dflash_jax as dj
    from dflash_jax.config import TargetConfig
    monkeypatch.setenv(au.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(au, "_EVIDENCE", {})  # what earlier tests observed on the same pair does not count
    monkeypatch.setattr(au, "MIN_EVIDENCE", 1)  # target-only may follow the first drafted call
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
    from dflash_jax.decode import prompt_and_cache_len
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
    # the evidence is on disk too: a new process (here: an empty in-memory table) starts from it
    import dataclasses
    monkeypatch.setattr(au, "_EVIDENCE", {})
    again = au.evidence_for(target, drafter)
    assert again is not ev and dataclasses.asdict(again) == dataclasses.asdict(ev) \
        and again.drafted == 1 and again.idle == 1
    with pytest.raises(ValueError, match="auto"):
        dj.generate(target, drafter, prompts, max_new_tokens=4, block_size=4, tree_budget="auto")
    for bad in (dict(shadow_trees=3), dict(block_size=4, tree_budget=3, shadow_trees=3), dict(block_size=4, shadow_trees=0)):
        with pytest.raises(ValueError, match="shadow_trees must be tree budgets >= 1 of a chain"):
            dj.generate(target, drafter, prompts, max_new_tokens=4, **bad)


@pytest.mark.parametrize("temperature,rest", [(0.0, "target-only"), (1.0, "target-only"), (0.0, "B=2"),
                                              (1.0, "B=2")])
def test_a_look_then_the_rest_with_another_shape_is_lossless(tmp_path, monkeypatch, temperature, rest):
    """A look runs LOOK_TOKENS with its shape, the rest goes on in the same decode state with another shape
    (target-only, or another drafted shape): one prefill for the whole call, and the output is what
    target-only gives, greedy and sampled with the same seed (own row ids); a row that stops inside the
    look is not continued."""
    import dflash_jax as dj
    import importlib
    from dflash_jax.decode import prompt_and_cache_len
    programs = importlib.import_module("dflash_jax.decode.cache").DEFAULT
    target, drafter = _tiny_pair(tmp_path, monkeypatch)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 3]]
    new = 3 * au.LOOK_TOKENS
    _, S = prompt_and_cache_len(5, new, max(au.TREE_BUDGETS) + 1)
    key = au.cost_key(target, drafter, 3, S)
    if rest == "target-only":  # nothing drafted pays
        costs = {s.key: (1.0 if s.block == 1 else 50.0) for s in au.candidate_shapes(4)}
    else:  # B=2 is cheaper than a target step (so it pays even with nothing accepted), the rest cost more
        costs = {s.key: (1.0 if s.block == 1 else 0.5 if s == au.Shape(2) else 50.0) for s in au.candidate_shapes(4)}
    (tmp_path / "shape_costs.json").write_text(json.dumps({key: costs}))
    kw = dict(max_new_tokens=new, temperature=temperature, seed=7, row_ids=[5, 1, 9])
    ref = dj.generate(target, None, prompts, max_cache_len=S, stop_token_ids=[], **kw)
    stop = ref.tokens[2][au.LOOK_TOKENS // 2]  # row 2 stops inside the look, the others may stop later
    ref = dj.generate(target, None, prompts, max_cache_len=S, stop_token_ids=[[], [], [stop]], **kw)
    kinds = []
    real = programs.compiled
    monkeypatch.setattr(programs, "compiled", lambda kind, *a, **k: (kinds.append(kind), real(kind, *a, **k))[1])
    got = dj.generate(target, drafter, prompts, block_size="auto", stop_token_ids=[[], [], [stop]], **kw)
    assert "no acceptance observed" in got.auto_reason and f"; then auto shape: {rest}" in got.auto_reason
    assert kinds == ["prefill", "loop", "loop"]  # the look's loop, then the rest's: no second prefill
    assert got.tokens == ref.tokens
    assert len(got.tokens[0]) == new and len(got.tokens[2]) <= au.LOOK_TOKENS // 2 + 1
    assert got.block_size == (1 if rest == "target-only" else 2)
    assert got.decode_tokens == sum(len(t) - 1 for t in got.tokens)
    assert sum(got.acceptance_lengths[0]) == new - 1 and len(got.acceptance_lengths[0]) <= got.cycles


def test_a_reference_call_times_target_steps_over_the_whole_call(tmp_path, monkeypatch):
    """With drafting chosen and no target step timed yet, a call runs target-only, whole (its steps timed over
    the positions drafted calls run, not only a row's later ones): output equal to target-only, the steps counted
    as cost evidence only (the choice stays drafted: not an idle call, the drafted shape still ran last)."""
    import dflash_jax as dj
    import importlib
    from dflash_jax.decode import prompt_and_cache_len
    programs = importlib.import_module("dflash_jax.decode.cache").DEFAULT
    target, drafter = _tiny_pair(tmp_path, monkeypatch)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    new = 3 * au.LOOK_TOKENS
    _, S = prompt_and_cache_len(5, new, max(au.TREE_BUDGETS) + 1)
    # B=2 priced below a target step: drafting pays by the curve, though (random drafter) little is accepted
    costs = {s.key: (1.0 if s.block == 1 else 0.8 if s == au.Shape(2) else 50.0) for s in au.candidate_shapes(4)}
    (tmp_path / "shape_costs.json").write_text(json.dumps({au.cost_key(target, drafter, 2, S): costs}))
    kw = dict(max_new_tokens=new, temperature=0.0, stop_token_ids=[])
    ref = dj.generate(target, None, prompts, max_cache_len=S, **kw)
    first = dj.generate(target, drafter, prompts, block_size="auto", **kw)  # the first look (full block)
    assert first.tokens == ref.tokens and "no acceptance observed" in first.auto_reason
    ev = au.evidence_for(target, drafter)
    ctx = f"b2|S{S}"
    assert ev.target_steps(ctx) == 0
    kinds = []
    real = programs.compiled
    monkeypatch.setattr(programs, "compiled", lambda kind, *a, **k: (kinds.append(kind), real(kind, *a, **k))[1])
    got = dj.generate(target, drafter, prompts, block_size="auto", **kw)
    assert got.tokens == ref.tokens
    assert got.auto_reason.startswith("auto shape: target-only, timing target steps (best drafted B=2")
    assert kinds == ["prefill", "loop"] and got.block_size == 1 and got.auto_look
    assert ev.target_steps(ctx) == pytest.approx(got.cycles) and got.cycles == new - 1
    assert ev.last == "B2" and ev.idle == 0


def test_evidence_decays_so_the_choice_follows_the_text_and_target_only_probes(monkeypatch):
    _one_part(monkeypatch)
    monkeypatch.setattr(au, "MIN_EVIDENCE", 2)
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    costs = {"target": 1.0, "B4": 2.0, "B8": 2.5}
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[6] * 2000])  # easy text, a long run: B=8 pays (6 / 2.5)
    assert au.choose(shapes, costs, ev).shape == au.Shape(8)
    ev.add(au.Shape(8), [[1] * 4 * au.HALF_LIFE])  # then text where nothing is accepted, 4 half-lives
    old = 2000 * 0.5 ** (4 + 1 / au.CALL_HALF_LIFE)  # the old text: 4 half-lives of cycles and one call later
    assert ev.accept_probs()[0] == pytest.approx(old / (old + 4 * au.HALF_LIFE))
    c = au.choose(shapes, costs, ev)
    assert c.shape == au.Shape(1)
    for _ in range(au.PROBE_EVERY - 1):
        ev.add(au.Shape(1), [[1]])
    probe = au.choose(shapes, costs, ev)
    assert probe.shape.block > 1 and "probing" in probe.reason
    ev.add(probe.shape, [[1] * 50])  # the probe does not pay: the next one waits twice as long
    assert ev.probe_every == 2 * au.PROBE_EVERY
    for _ in range(au.PROBE_EVERY - 1):
        ev.add(au.Shape(1), [[1]])
    assert au.choose(shapes, costs, ev).shape == au.Shape(1)
    for _ in range(au.PROBE_EVERY):
        ev.add(au.Shape(1), [[1]])
    probe = au.choose(shapes, costs, ev)
    assert "probing" in probe.reason
    ev.add(probe.shape, [[min(6, probe.shape.block)] * 4 * au.HALF_LIFE])  # the easy text is back
    nxt = au.choose(shapes, costs, ev)
    assert nxt.shape.block > 1 and "probing" not in nxt.reason
    ev.add(nxt.shape, [[min(6, nxt.shape.block)] * 100])  # drafting pays again: probes back to the start
    assert ev.probe_every == au.PROBE_EVERY


@pytest.mark.parametrize("near", [True, False])
def test_a_near_miss_keeps_probing_every_probe_every_calls(monkeypatch, near):
    """With target-only chosen and the probe interval backed off, a best drafted shape expected at PROBE_NEAR x
    or more (under the hurdle) is probed every PROBE_EVERY-th call all the same; one further off waits out the
    backed-off interval (run O: MBPP after HumanEval ran target-only for 31 calls where B=4 paid 1.06x)."""
    _one_part(monkeypatch)
    monkeypatch.setattr(au, "MIN_EVIDENCE", 1)
    shapes = au.candidate_shapes(4, blocks=(4,), trees=())
    ev = au.Evidence(full_block=4)
    ev.add(au.Shape(4), [[2] * 2000])  # tau 2 at B=4
    cost = 2.0 / (1.02 if near else 0.9)  # expected 1.02x (a near miss under HURDLE) or 0.90x
    costs = {"target": 1.0, "B4": cost}
    assert au.choose(shapes, costs, ev).shape == au.Shape(1)
    ev.probe_every = au.PROBE_MAX  # probes backed off (e.g. by another text's)
    for _ in range(au.PROBE_EVERY - 1):
        ev.add(au.Shape(1), [[1]])
    c = au.choose(shapes, costs, ev)
    assert ("probing" in c.reason and c.shape == au.Shape(4)) == near
    for _ in range(au.PROBE_MAX - au.PROBE_EVERY):
        ev.add(au.Shape(1), [[1]])
    assert "probing" in au.choose(shapes, costs, ev).reason  # the backed-off interval is up either way


def _fit(obs: dict, curve: dict):
    """(log step, drift) minimising the documented objective, by brute least squares on stacked rows:
    sqrt(weight) x (residual) for every target-only cycle weight, drafted shape and the drift prior."""
    A, y = [], []
    for k, (ly, n) in obs.items():
        wt = n if k == "target" else n * au.COST_PRIOR / (n + au.COST_PRIOR)
        A.append([np.sqrt(wt), 0.0 if k == "target" else np.sqrt(wt)])
        y.append(np.sqrt(wt) * (ly - (0.0 if k == "target" else np.log(curve[k]))))
    A.append([0.0, np.sqrt(au.DRIFT_PRIOR)])
    y.append(0.0)
    return np.linalg.lstsq(np.array(A), np.array(y), rcond=None)[0]


def test_observed_cycle_times_refine_the_cost_curve():
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    curve = {"target": 1.0, "B4": 1.5, "B8": 2.0}
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[3] * 100])
    assert ev.cost(au.Shape(4), curve, "b1") == 1.5  # nothing observed: the curve
    assert au.choose(shapes, curve, ev, context="b1").shape == au.Shape(4)  # 3 / 1.5 vs 3 / 2
    # real calls: a target step takes 10 ms, a B=4 cycle 40 ms (4 steps, not the curve's 1.5)
    P = au.COST_PRIOR
    ev.add(au.Shape(1), [[1] * 2000], seconds=20.0, cycles=2000, context="b1")
    ev.add(au.Shape(4), [[3] * P], seconds=0.04 * P, cycles=P, context="b1")
    nt = 2000 * 0.5 ** (P / (4 * au.HALF_LIFE))  # target-only's cycles, decayed by B=4's P since
    log_step, drift = _fit({"target": (np.log(0.01), nt), "B4": (np.log(0.04), P)}, curve)
    assert log_step == pytest.approx(np.log(0.01), abs=0.03)  # target-only's many cycles fix the step time
    assert 0.3 < drift < np.log(4.0 / 1.5)  # B=4 runs 2.7x its curve: the shared drift takes part of it
    want4 = np.exp((P * (np.log(1.5) + drift) + P * (np.log(0.04) - log_step)) / (2 * P))
    assert ev.cost(au.Shape(4), curve, "b1") == pytest.approx(want4)
    assert 3.0 < want4 < 4.0  # its own cycles and the drifted curve, half and half
    # B=8 never ran: the curve times the drift every drafted shape shares
    assert ev.cost(au.Shape(8), curve, "b1") == pytest.approx(2.0 * np.exp(drift))
    assert ev.cost(au.Shape(4), curve, "b8") == 1.5  # another batch / cache context: not these times
    ev.add(au.Shape(4), [[3] * P], seconds=0.04 * 4 * P, cycles=4 * P, context="b1")  # more of the same
    assert ev.cost(au.Shape(4), curve, "b1") > 3.5
    # B=8's cost rose with the drift too (B=4 is the only drafted evidence) ...
    assert ev.cost(au.Shape(8), curve, "b1") > 2.0 * 1.5
    # ... until B=8's own calls run at its curve (20 ms a cycle): the drift falls, its own times rule, it wins
    ev.add(au.Shape(8), [[3] * P], seconds=0.02 * 2 * P, cycles=2 * P, context="b1")
    assert ev.cost(au.Shape(8), curve, "b1") < 2.0 * 1.2
    assert au.choose(shapes, curve, ev, context="b1").shape == au.Shape(8)
    # without target-only calls the drift cannot be told from the step time: it stays 0, and a step's time
    # comes from the drafted shapes' times through the curve
    ev2 = au.Evidence(full_block=8)
    ev2.add(au.Shape(4), [[3] * 100], seconds=1.5, cycles=100, context="c")  # 15 ms / cycle = 1.5 x 10 ms
    ev2.add(au.Shape(8), [[3] * 100], seconds=3.0, cycles=100, context="c")  # 30 ms / cycle
    assert ev2.cost(au.Shape(8), curve, "c") > curve["B8"] > ev2.cost(au.Shape(4), curve, "c")
    log_step2, drift2 = _fit({"B4": (np.log(0.015), 100), "B8": (np.log(0.030), 100)}, curve)
    assert drift2 == pytest.approx(0.0, abs=1e-9)
    # a few slow target-only calls (load) move the step time, not every drafted cost by their whole ratio
    ev3 = au.Evidence(full_block=8)
    ev3.add(au.Shape(4), [[3] * 600], seconds=600 * 0.015, cycles=600, context="d")  # as the curve: 10 ms steps
    ev3.add(au.Shape(1), [[1] * 80], seconds=80 * 0.012, cycles=80, context="d")  # 12 ms steps, 80 cycles
    assert 1.5 * 10 / 12 < ev3.cost(au.Shape(4), curve, "d") < 1.5
    # every drafted shape 10% dearer than its curve in real calls: a shape not run since is 10% dearer too
    ev4 = au.Evidence(full_block=8)
    ev4.add(au.Shape(1), [[1] * 4000], seconds=4000 * 0.01, cycles=4000, context="e")
    ev4.add(au.Shape(8), [[3] * 2000], seconds=2000 * 0.01 * 2.0 * 1.1, cycles=2000, context="e")
    assert ev4.cost(au.Shape(8), curve, "e") == pytest.approx(2.2, rel=0.01)
    nt4 = 4000 * 0.5 ** (2000 / (4 * au.HALF_LIFE))
    _, drift4 = _fit({"target": (np.log(0.01), nt4), "B8": (np.log(0.022), 2000)}, curve)
    assert ev4.cost(au.Shape(4), curve, "e") == pytest.approx(1.5 * np.exp(drift4))
    assert 1.5 * 1.07 < ev4.cost(au.Shape(4), curve, "e") < 1.5 * 1.1  # most of the 10% (the prior keeps a little)


def test_a_cost_compares_only_timings_taken_together(_still_clock):
    """A drafted cycle's cost is its time over a target step's: target steps timed minutes before (the machine's
    speed moved since) must not price the cycles timed now. Costs come from time windows that timed both: cycles
    timed alone keep the cost those windows gave, and old windows fade (TIME_HALF_LIFE)."""
    curve = {"target": 1.0, "B4": 1.5, "B8": 2.0}
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(1), [[1] * 500], seconds=500 * 0.012, cycles=500, context="b1")  # steps at 12 ms then ...
    ev.add(au.Shape(8), [[3] * 300], seconds=300 * 0.0216, cycles=300, context="b1")  # ... B=8 at 1.8 steps
    paired = ev.cost(au.Shape(8), curve, "b1")
    assert 1.8 < paired < 1.9  # mostly its own 1.8 (the curve's 2.0 worth COST_PRIOR cycles, the drift's prior)
    assert ev.target_steps("b1") == pytest.approx(500 * 0.5 ** (300 / (4 * au.HALF_LIFE)))
    _still_clock[0] += 3 * au.TIME_WINDOW  # later the machine is faster: B=8 at 14.4 ms, steps (untimed) at 8 ms
    ev.add(au.Shape(8), [[3] * 400], seconds=400 * 0.0144, cycles=400, context="b1")
    # one fit over every timing would set those cycles against the 12-ms steps: 1.2 steps
    assert ev.cost(au.Shape(8), curve, "b1") == pytest.approx(paired, rel=0.01)
    assert ev.cost(au.Shape(4), curve, "b1") < 1.5  # B=4 shares the drift B=8's paired window showed
    # timed together again (steps at 8 ms): B=8 is 1.8 steps still
    _still_clock[0] += 1.0
    ev.add(au.Shape(1), [[1] * 500], seconds=500 * 0.008, cycles=500, context="b1")
    assert ev.cost(au.Shape(8), curve, "b1") == pytest.approx(paired, rel=0.02)
    # old windows fade: two hours later the curve rules again, whatever was timed
    _still_clock[0] += 7200.0
    assert ev.target_steps("b1") < 1.0
    assert ev.cost(au.Shape(8), curve, "b1") == pytest.approx(2.0, rel=0.01)
    # the evidence on disk carries its clock: a later process weighs it by its age
    again = au.Evidence(**json.loads(json.dumps(dataclasses.asdict(ev))))
    assert again.clock == ev.clock and again.target_steps("b1") == pytest.approx(ev.target_steps("b1"))


def test_a_cost_compares_timings_at_their_cache_fill(_still_clock):
    """A step or a cycle over a fuller cache takes longer: a target step timed on a long prompt must not price the
    cycles of short ones (one slope for both, learnt from calls at different fills)."""
    curve = {"target": 1.0, "B4": 1.5, "B8": 2.0}
    step = lambda f: 0.01 * np.exp(0.3 * f / au.FILL_UNIT)  # noqa: E731 - 10 ms at an empty cache, +35% per 256 tokens
    true4 = 2.0  # a B=4 cycle: 2 steps at the same fill
    ev = au.Evidence(full_block=8)
    for f in (100.0, 300.0, 500.0, 200.0, 400.0):  # B=4 calls at several fills, one target-only call on a long prompt
        ev.add(au.Shape(4), [[3] * 200], seconds=200 * true4 * step(f), cycles=200, context="b1", fill=f)
    ev.add(au.Shape(1), [[1] * 200], seconds=200 * step(700.0), cycles=200, context="b1", fill=700.0)
    assert ev.cost(au.Shape(4), curve, "b1") == pytest.approx(true4, rel=0.06)  # (the priors lean to the curve's 1.5)
    # the same timings without their fills: the long prompt's steps make B=4 look cheap
    blind = au.Evidence(full_block=8)
    for f in (100.0, 300.0, 500.0, 200.0, 400.0):
        blind.add(au.Shape(4), [[3] * 200], seconds=200 * true4 * step(f), cycles=200, context="b1")
    blind.add(au.Shape(1), [[1] * 200], seconds=200 * step(700.0), cycles=200, context="b1")
    assert blind.cost(au.Shape(4), curve, "b1") < 0.85 * true4
    # the mean fill of a call: its prompt, what was generated before it and what its cycles committed before each
    assert au.mean_fill([10, 20], [[2, 3], [1]]) == pytest.approx((10 + 12 + 20) / 3)
    assert au.mean_fill([10], [[4, 4]], offset=64) == pytest.approx(74 + 2)
    assert au.mean_fill([10], [[]]) is None


def test_cost_curve_measures_at_the_first_calls_prompt_length(tmp_path, monkeypatch):
    """The curve's random prompts are as long as the prompt generate() passes (attention cost follows the
    fill: 256-token prompts in a 1024 cache priced B=2 at 1.43 steps where 150-token GSM8K calls cost 1.6),
    and a quarter of the cache without one; a cache too small for that keeps its room for the new tokens."""
    import sys
    import types
    monkeypatch.setenv(au.ENV_DIR, str(tmp_path))
    seen = []

    def fake(target, drafter, prompts, **kw):
        seen.append({len(p) for p in prompts})
        return types.SimpleNamespace(decode_time=0.01 * (1 + (kw.get("block_size") or 1)), cycles=10)

    monkeypatch.setattr(sys.modules["dflash_jax.decode.api"], "generate", fake)
    monkeypatch.setattr(au, "pair_key", lambda t, d: "k")
    shapes = au.candidate_shapes(4, blocks=(4,), trees=())
    tgt = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
    au.cost_curve(tgt, None, 2, 1024, shapes, rounds=1, prompt_len=150)
    assert seen and all(s == {150} for s in seen)
    seen.clear()
    au.cost_curve(tgt, None, 2, 2048, shapes, rounds=1)
    assert seen and all(s == {512} for s in seen)
    seen.clear()
    au.cost_curve(tgt, None, 2, 128, shapes, rounds=1, prompt_len=500)
    assert seen and all(s == {128 - 4 - 48 - 1} for s in seen)


def test_cost_curve_times_the_layout_probes_before_its_compile_threads(tmp_path, monkeypatch):
    """The decode loop's weight layout is chosen by a timing (layers.rows_faster): cost_curve takes it for every
    drafted shape on the calling thread before compiling the shapes in threads, whose load would skew it."""
    import sys
    import threading
    import types
    from dflash_jax import layers
    gen = sys.modules["dflash_jax.decode.programs"]
    monkeypatch.setenv(au.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(gen.jax, "default_backend", lambda: "cpu")
    probed = []
    monkeypatch.setattr(layers, "_probe_rows", lambda i, o, r: probed.append((r, threading.current_thread()
                                                                               is threading.main_thread())) or False)
    monkeypatch.setattr(layers, "_ROWS_PROBED", {})

    def fake(target, drafter, prompts, **kw):  # as generate(): the layout question comes with the call
        w = gen.verify_width(kw.get("block_size") or 1, kw.get("tree_budget"))
        gen.rows_pay(target, drafter, w)
        return types.SimpleNamespace(decode_time=0.01 * (1 + (kw.get("block_size") or 1)), cycles=10)

    monkeypatch.setattr(sys.modules["dflash_jax.decode.api"], "generate", fake)
    monkeypatch.setattr(au, "pair_key", lambda t, d: "k")
    shapes = au.candidate_shapes(16, blocks=(4, 8), trees=(7,))
    cfg = types.SimpleNamespace(vocab_size=100, hidden_size=8, intermediate_size=16)
    au.cost_curve(types.SimpleNamespace(config=cfg), types.SimpleNamespace(), 1, 1024, shapes, rounds=1)
    assert sorted(r for r, _ in probed) == [4, 8, 16]  # B=4, B=8, tree 7 (the drafter's 16 rows): one per bucket ...
    assert all(main for _, main in probed)  # ... each on the calling thread


def test_cost_curve_fits_a_small_cache(tmp_path, monkeypatch):
    """Measuring in a cache barely wider than the widest shape shortens the runs instead of overflowing it."""
    target, drafter = _tiny_pair(tmp_path, monkeypatch)
    shapes = [au.Shape(1), au.Shape(4), au.Shape(4, 64)]
    costs = au.cost_curve(target, drafter, 1, 128, shapes, rounds=1)
    assert set(costs) == {"target", "B4", "tree64"} and costs["target"] == 1.0
    assert costs["tree64"] >= costs["B4"] > 0
    stored = json.loads((tmp_path / "shape_costs.json").read_text())
    assert stored[au.cost_key(target, drafter, 1, 128)] == costs


def test_generate_defaults_to_auto_with_a_drafter_only(tmp_path, monkeypatch):
    """generate()'s default shape is auto with a drafter (after the plain path's input checks);
    block_size None / an int / a tree budget fix the shape; without a drafter the default is plain
    target-only decoding, no cost curve."""
    import importlib
    gen = importlib.import_module("dflash_jax.decode.api")
    target, drafter = _tiny_pair(tmp_path, monkeypatch)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    calls = []
    real_auto = gen.generate_auto
    monkeypatch.setattr(gen, "generate_auto", lambda t, d, ps, **kw: calls.append(kw) or "auto")
    assert gen.generate(target, drafter, prompts, max_new_tokens=4) == "auto"
    assert calls[-1]["max_new_tokens"] == 4 and calls[-1]["max_cache_len"] is None
    assert gen.generate(target, drafter, prompts, max_new_tokens=4, shape="auto") == "auto"
    assert gen.generate(target, drafter, prompts, max_new_tokens=4, block_size=None, tree_budget="auto") == "auto"
    with pytest.warns(UserWarning, match="capped to 2"):  # the plain path's cap and warning, before auto
        gen.generate(target, drafter, [[1] * 510], max_new_tokens=100)
    assert calls[-1]["max_new_tokens"] == 2
    n = len(calls)
    for kw, msg in [(dict(prompts=[]), "prompts is empty"), (dict(prompts=[[1], []]), "prompt 1 is empty"),
                    (dict(prompts=[[1, 16]]), r"token ids must lie in \[0, 16\)"),
                    (dict(prompts=[[1] * 513]), "exceeds the model's max_position_embeddings"),
                    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
                    (dict(temperature=float("nan")), "temperature must be a finite number"),
                    (dict(stop_token_ids=[[1]]), "per-row stop_token_ids has 1 rows for 2 prompts")]:
        with pytest.raises(ValueError, match=msg):
            gen.generate(target, drafter, **{"prompts": prompts, "max_new_tokens": 4, **kw})
    assert len(calls) == n  # each a clear error before auto ran

    def no_curve(*a, **k):
        raise AssertionError("cost curve measured")
    monkeypatch.setattr(au, "cost_curve", no_curve)
    kw = dict(max_new_tokens=6, stop_token_ids=[])
    ref = gen.generate(target, None, prompts, **kw)  # no drafter: the default is target-only
    assert ref.block_size == 1 and ref.tree_budget is None
    for fixed, block, tree in [(dict(block_size=None), 4, None), (dict(block_size=2), 2, None),
                               (dict(tree_budget=3), 4, 3)]:  # a tree of the drafter's depth
        r = gen.generate(target, drafter, prompts, **fixed, **kw)
        assert (r.block_size, r.tree_budget) == (block, tree) and r.tokens == ref.tokens, fixed
    assert len(calls) == n
    monkeypatch.setattr(gen, "generate_auto", real_auto)
    assert gen.generate(target, None, prompts, tree_budget="auto", **kw).tokens == ref.tokens
    with pytest.raises(ValueError, match="tree_budget needs a drafter"):
        gen.generate(target, None, prompts, tree_budget=3, **kw)


def test_processes_agree_on_the_curve_and_the_choice(tmp_path, monkeypatch):
    """Multi-host: every process takes process 0's cost curve and choice (each times its own calls;
    processes running different programs in one mesh would stall). Simulated: process 0's values
    come from a stub of the broadcast."""
    monkeypatch.setenv(au.ENV_DIR, str(tmp_path))
    shapes = au.candidate_shapes(4, blocks=(2, 4), trees=(4,))
    zero = {"target": 1.0, "B2": 1.3, "B4": 1.6, "tree4": 2.0}  # what process 0 holds
    sent = []

    monkeypatch.setattr(au, "_process_count", lambda: 2)
    monkeypatch.setattr(au, "_from_process_0", lambda values: (sent.append(list(values)), [zero[s.key] for s in shapes]
                                                             if len(values) == len(shapes) else [1, 0, 0])[1])
    target = drafter = None
    monkeypatch.setattr(au, "cost_key", lambda *a: "k")
    # this process has no curve on disk: it takes process 0's without measuring (no generate call)
    assert au.cost_curve(target, drafter, 1, 128, shapes) == zero
    assert sent[-1] == [-1.0] * len(shapes)  # what it held: nothing
    mine = au.Choice(au.Shape(4), "auto shape: B=4 (...)", look=True, reference=True)
    got = au.agree(mine, shapes)  # process 0 chose shapes[1] = B=2, no look (so no target-only rest either)
    assert got.shape == au.Shape(2) and not got.look and not got.reference and "process 0's choice" in got.reason
    assert sent[-1] == [shapes.index(au.Shape(4)), 1, 1]
    monkeypatch.setattr(au, "_process_count", lambda: 1)
    assert au.agree(mine, shapes) is mine


def test_the_rest_of_a_call_follows_its_own_look(monkeypatch):
    """After a look, the rest of the call (part REST) is chosen with the model's later part scaled by how this
    answer's look drafted against what the model expected of it: one answer is the best guide to its own
    rest, and a look that drafts as expected leaves the later part's own (higher) estimate standing."""
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)  # the plain per-depth estimates, checked exactly
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    costs = {"target": 1.0, "B4": 2.0, "B8": 2.8}
    ev = au.Evidence(full_block=8)
    for _ in range(4):  # earlier text: B=8 commits 2 a cycle in the first LOOK_TOKENS tokens, 6 after
        ev.add(au.Shape(8), [[2] * (au.LOOK_TOKENS // 2) + [6] * 30])
    assert ev.tau(au.Shape(8), 1) == pytest.approx(2.0) and ev.tau(au.Shape(8), au.REST) == pytest.approx(6.0)
    assert au.choose(shapes, costs, ev, look=False, part=au.REST).shape == au.Shape(8)
    # a look that drafts as the model expected: the rest goes on with B=8 at the later part's 6 a cycle
    same = ev.for_the_rest(au.Shape(8), [[2] * (au.LOOK_TOKENS // 2)])
    assert same.scale == pytest.approx(1.0) and same.tau(au.Shape(8), au.REST) == pytest.approx(6.0)
    assert au.choose(shapes, costs, same, look=False, part=au.REST).shape == au.Shape(8)
    # this answer: 1.25 a cycle where the model expected 2 -> accepted drafts x (0.25 n + 8 x 1) / (n + 8)
    look = [[1, 2, 1, 1] * 12]
    rest = ev.for_the_rest(au.Shape(8), look)
    n = len(look[0]) - 1  # the row's last look cycle is cut at the look's budget: not counted
    obs = sum(x - 1 for x in look[0][:-1])
    want = (obs + au.RATIO_PRIOR) / (n + au.RATIO_PRIOR)  # expected 1 accepted draft a cycle
    assert rest.scale == pytest.approx(want)
    assert rest.tau(au.Shape(8), au.REST) == pytest.approx(1 + 5 * want)
    assert au.choose(shapes, costs, rest, look=False, part=au.REST).shape == au.Shape(1)
    assert ev.tau(au.Shape(8), au.REST) == pytest.approx(6.0) and ev.scale == 1.0  # self is left as it was
    assert rest.risk[0][1] > ev.risk[0][1]  # the look's cycles are in the rest's evidence
    # a part decays only in calls that observed it: looks alone leave the later part's evidence standing
    before = ev.risk[au.REST][1]
    ev.add(au.Shape(8), look)
    assert ev.risk[au.REST][1] == before and ev.risk[0][1] < 4 * (au.LOOK_TOKENS // 2)


def test_after_target_only_calls_the_last_drafted_calls_level_prices_drafting(monkeypatch):
    """The per-depth model moves with the calls that observe it (CALL_HALF_LIFE), so after a change of text it
    lags for several drafted calls; with target-only chosen (few drafted calls come then: probes), a whole call's
    estimates are the model's times how the last drafted calls drafted against it (`Evidence.recent_scale`) - MT-Bench
    after the other sets, session 22's run J: B=8 ran whole calls at an expected 1.11x (tau 2.78) that ran at 0.6x
    (tau 1.6). While drafting, the model alone (one hard answer must not stop drafting that pays on average)."""
    _one_part(monkeypatch)
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)
    monkeypatch.setattr(au, "REF_BELOW", 0.0)  # no call to time target steps: not this test's subject
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    costs = {"target": 1.0, "B4": 2.0, "B8": 2.5}
    ev = au.Evidence(full_block=8)
    for _ in range(40):  # easy text: B=8 commits 4 a cycle
        ev.add(au.Shape(8), [[4] * 50])
    assert ev.recent_scale() == pytest.approx(1.0, abs=0.02)  # the calls drafted as the model expected them to
    model = ev.tau(au.Shape(4))
    for _ in range(3):  # then a text that commits 1.5 a cycle
        ev.add(au.Shape(8), [[1, 2] * 30])
    assert ev.recent_scale() < 0.6
    # a drafted call ran last: the model alone, still above the hurdle
    c = au.choose(shapes, costs, ev)
    assert c.shape == au.Shape(4) and f"tau {ev.tau(au.Shape(4)):.2f}" in c.reason and ev.tau(au.Shape(4)) > 2.5
    ev.add(au.Shape(1), [[1] * 20])  # a target-only call (the choice of another call, e.g. a first look's rest)
    c = au.choose(shapes, costs, ev)
    assert c.shape == au.Shape(1)
    assert 2.5 < ev.tau(au.Shape(4)) < model and ev.scale == 1.0  # choose leaves the evidence as it was
    # a probe on the new text (a drafted call right after target-only ones): the call after it is judged the same way
    ev.add(au.Shape(4), [[1, 2] * 10])
    assert ev.idle == 0 and ev.probed and au.choose(shapes, costs, ev).shape == au.Shape(1)
    ev.add(au.Shape(4), [[2] * 20])  # a drafted call that was not a probe: the model alone again
    assert not ev.probed and au.choose(shapes, costs, ev).shape == au.Shape(4)
    ev.add(au.Shape(1), [[1] * 20])
    assert au.choose(shapes, costs, ev).shape == au.Shape(1)
    monkeypatch.setattr(au, "RECENT_HALF_LIFE", 0.0)  # without it: the lagging model drafts whole calls again
    assert au.choose(shapes, costs, ev).shape == au.Shape(4)


def test_a_whole_call_is_not_judged_on_a_later_part_no_recent_call_reached(monkeypatch):
    """The later part's counts are kept through calls that never reach it (looks), but after STALE_CALLS such
    drafted calls a whole call's estimate reads part 1 there: easy long answers first, then only looks at harder
    text must not keep choosing a drafted shape for whole long calls on the old text's later part."""
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)
    ev = au.Evidence(full_block=8)
    for _ in range(4):  # long answers: 2 a cycle in the first LOOK_TOKENS tokens, 7 after
        ev.add(au.Shape(8), [[2] * (au.LOOK_TOKENS // 2) + [7] * 40])
    ev.add_lengths([au.LOOK_TOKENS + 280] * 4)
    fresh = ev.tau(au.Shape(8))
    assert ev.rest_age == 0 and fresh > 4.0
    for k in range(au.STALE_CALLS + 1):  # looks that end at the look's budget: parts 0-1 only, 1.5 a cycle
        ev.add(au.Shape(8), [[1, 2] * (au.LOOK_TOKENS // 3)])
        assert ev.rest_age == k + 1
        if k + 1 == au.STALE_CALLS:
            kept = ev.tau(au.Shape(8))
    assert ev.tau(au.Shape(8), au.REST) == pytest.approx(7.0)  # the counts are kept (the rest of a look reads them)
    late = ev.tau(au.Shape(8))
    assert late < kept and late == pytest.approx(ev.blend(lambda q: ev.tau(au.Shape(8), min(q, 1))))
    ev.add(au.Shape(8), [[7] * 40], offset=au.LOOK_TOKENS)  # a call's rest reaches the later part again
    assert ev.rest_age == 0


def test_a_call_times_target_steps_where_the_curve_alone_prices_drafting(monkeypatch):
    """Where no target-only steps were timed (drafting chosen every call) and the best drafted shape is expected
    below REF_BELOW, a call runs target-only: the drift of the drafted shapes from the curve becomes measurable.
    Those steps are cost evidence only (the choice stays drafted)."""
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    costs = {"target": 1.0, "B4": 2.2, "B8": 2.5}
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[3] * 100], seconds=1.0, cycles=100, context="c")
    c = au.choose(shapes, costs, ev, context="c")
    assert c.shape == au.Shape(1) and c.look and c.reference and "timing target steps (best drafted B=4" in c.reason
    assert not au.choose(shapes, costs, ev, context="c", look=False).reference  # the rest of a call: never
    # the B=8 cycles took 10 ms, the steps 2 ms: drafted shapes cost 5 / 2.5 = 2x their curve
    ev.add(au.Shape(1), [[1] * 200], seconds=0.4, cycles=200, context="c", reference=True)
    assert ev.last == "B8" and ev.idle == 0  # not a target-only call: no probe interval, no "ran last"
    assert ev.target_steps("c") == pytest.approx(200.0)
    c = au.choose(shapes, costs, ev, context="c")
    assert not c.reference and c.shape == au.Shape(1)  # at twice the curve nothing drafted pays
    # easy text: the best drafted shape is expected well above REF_BELOW, no steps needed
    ev2 = au.Evidence(full_block=8)
    ev2.add(au.Shape(8), [[8] * 100], seconds=1.0, cycles=100, context="c")
    assert not au.choose(shapes, costs, ev2, context="c").reference


def test_a_near_tie_keeps_the_shape_that_ran_last(monkeypatch):
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)
    monkeypatch.setattr(au, "COST_TRY", 9.0)  # no cost looks here (their own test)
    _one_part(monkeypatch)
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[4] * 10])  # tau: B=4 4, B=8 4
    costs = {"target": 1.0, "B4": 2.0, "B8": 2.0 * 1.02}  # B=4 expected 2% faster
    assert au.choose(shapes, costs, ev).shape == au.Shape(8)  # B=8 ran last: kept within SWITCH_MARGIN
    ev.last = "B4"
    assert au.choose(shapes, costs, ev).shape == au.Shape(4)
    costs["B8"] = 2.0 * 1.05  # beyond the margin: the faster one
    ev.last = "B8"
    assert au.choose(shapes, costs, ev).shape == au.Shape(4)


def test_a_shape_close_to_the_best_whose_cost_rests_on_the_curve_gets_timed(monkeypatch):
    """A drafted shape within COST_TRY of the best whose cycles were timed in fewer than COST_CYCLES lately runs a
    look (its cost is measured instead of trusted to the curve); once timed, the estimates decide."""
    monkeypatch.setattr(au, "DEPTH_PRIOR", 0.0)
    _one_part(monkeypatch)
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[4] * 10], seconds=1.0, cycles=10)  # tau: B=4 4, B=8 4; B=8's cycles timed
    costs = {"target": 1.0, "B4": 2.0, "B8": 2.0 * 0.95}  # B=4 expected 5% slower: within COST_TRY, never timed
    c = au.choose(shapes, costs, ev)
    assert c.shape == au.Shape(4) and c.look and "timing it" in c.reason
    assert au.choose(shapes, costs, ev, look=False).shape == au.Shape(8)  # the rest of a call: the best estimate
    ev.add(au.Shape(4), [[4] * au.COST_CYCLES], seconds=0.1 * au.COST_CYCLES / 0.95, cycles=au.COST_CYCLES)  # as priced
    ev.last = "B8"
    assert au.choose(shapes, costs, ev).shape == au.Shape(8)  # timed: B=8 the best (its costs from the fit)
    costs["B8"] = 2.0 * au.COST_TRY * 0.9  # B=4 far behind: no look at it
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[4] * 10], seconds=1.0, cycles=10)
    assert au.choose(shapes, costs, ev).shape == au.Shape(8)


def test_a_deeper_chain_runs_when_the_depths_past_the_best_are_little_seen(monkeypatch):
    """Only B=4 ran lately: depths 4+ rest on the prior (0.9 x the depth before), so a deeper chain whose
    estimate comes within DEEP_TRY of B=4's runs a whole call; once its cycles saw those depths, the plain
    estimate decides again."""
    monkeypatch.setattr(au, "COST_TRY", 9.0)  # no cost looks here (their own test)
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    curve = {"target": 1.0, "B4": 1.5, "B8": 2.6}
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(4), [[4] * 300], offset=au.EARLY_TOKENS)  # every draft accepted, censored at the block
    assert all(r[4] == 0 for r in ev.risk) and ev.risk[au.REST][3] > 100
    r4, r8 = ev.tau(au.Shape(4)) / 1.5, ev.tau(au.Shape(8)) / 2.6
    assert au.DEEP_TRY <= r8 / r4 < 1.0  # B=8 a little behind on the prior's word
    c = au.choose(shapes, curve, ev)
    assert c.shape == au.Shape(8) and "little seen lately" in c.reason and c.look
    assert au.choose(shapes, curve, ev, look=False).shape == au.Shape(4)  # the rest of a call: best estimate only
    # B=8's call shows the deep drafts rejected: the depths are seen, B=4 is the best and stays
    ev.add(au.Shape(8), [[4] * 100], offset=au.EARLY_TOKENS)
    assert ev.risk[au.REST][4] >= au.DEPTH_PRIOR
    assert au.choose(shapes, curve, ev).shape == au.Shape(4)


def test_a_probe_looks_deeper_when_no_call_verified_the_depth_past_its_chain_lately(monkeypatch):
    """Depths are kept until a call verifies them again, so after many calls of a short chain (B=4 probes) the
    depths past it may hold a few early answers' counts; after DEEP_AGE drafted calls that never reached them, a
    probe from target-only runs the deeper chain when its estimate is within DEEP_TRY."""
    monkeypatch.setattr(au, "MIN_EVIDENCE", 0)
    shapes = au.candidate_shapes(8, blocks=(4, 8), trees=())
    costs = {"target": 1.0, "B4": 4.0, "B8": 4.2}  # nothing drafted clears the hurdle: target-only, with probes
    ev = au.Evidence(full_block=8)
    ev.add(au.Shape(8), [[4] * 50])  # depths 1-4 verified, draft 4 always rejected: B=8 commits what B=4 does
    assert ev.depth_age[4] == 0 and ev.risk[1][4] >= au.DEPTH_PRIOR
    for k in range(au.DEEP_AGE):
        ev.add(au.Shape(4), [[3] * 50])  # B=4: drafts 1-2 accepted, 3 rejected: depth 4 never verified
        while ev.idle < ev.probe_every - 1:  # target-only calls until a probe is due
            ev.add(au.Shape(1), [[1]])
        probe = au.choose(shapes, costs, ev)
        assert "probing" in probe.reason and probe.look
        assert ev.depth_age[4] == k + 1
        assert probe.shape == (au.Shape(8) if k + 1 >= au.DEEP_AGE else au.Shape(4))
    ev.add(au.Shape(8), [[3] * 50])  # B=8's probe: rejected at 3, so depth 4 still unverified ...
    assert ev.depth_age[4] == au.DEEP_AGE + 1
    ev.add(au.Shape(8), [[5] * 50])  # ... until a call reaches it
    assert ev.depth_age[4] == 0 and ev.depth_age[7] == au.DEEP_AGE + 3
