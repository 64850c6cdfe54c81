"""decode.auto_glue: generate(block_size="auto") on device - lossless whole calls and looks continued in place, the
one-line reason, no recompilation once a shape ran, evidence persisted in $DFLASH_JAX_CACHE, the cost curve measured
once per (batch, cache) from a few timed shapes, multi-host agreement."""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import types

import pytest

from dflash_jax.auto import AutoPolicy, Shape, candidate_shapes, store
from dflash_jax.decode import auto_glue as glue
from dflash_jax.decode.state import prompt_and_cache_len

programs = importlib.import_module("dflash_jax.decode.cache").DEFAULT


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """A tiny random target + 4-block drafter; auto's cache in tmp_path, nothing remembered from earlier tests."""
    import dflash_jax as dj
    from dflash_jax.config import TargetConfig
    monkeypatch.setenv(store.ENV_DIR, str(tmp_path))
    for name in ("_EVIDENCE", "_SHOWN"):
        monkeypatch.setattr(glue, name, {})
    monkeypatch.setattr(glue, "_TOLD", set())
    cfg = TargetConfig(family="qwen3", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, max_position_embeddings=512)
    target = dj.init_target(cfg, seed=1, std=0.6)
    return target, dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=15, seed=2, std=0.1,
                                   target_layer_ids=(0, 1))


def _cache_len(longest, new):
    return prompt_and_cache_len(longest, new, max(glue.width(s) for s in candidate_shapes(4)))[1]


def _store_curve(target, drafter, batch, S, costs):
    """A curve on disk as a measurement leaves it."""
    key = store.curve_key(store.pair_key(target, drafter), batch, S)
    store.save({"version": store.VERSION, "curves": {key: costs}, "evidence": {}})
    return key


def _dear(price=50.0, cheap=None):
    """Every drafted shape at `price` target steps a cycle (`cheap`: that one at 0.5)."""
    return {s.key: 1.0 if s.block == 1 else 0.5 if s == cheap else price for s in candidate_shapes(4)}


def test_measured_shapes_and_the_derived_curve():
    shapes = candidate_shapes(16)
    assert [s.key for s in glue.measured_shapes(shapes)] == ["target", "B4", "B16", "tree7", "tree63"]
    assert [s.key for s in glue.measured_shapes(candidate_shapes(4))] == ["target", "B2", "B4", "tree7", "tree63"]
    curve = glue.derive_curve({"target": 1.0, "B4": 2.0, "B16": 3.2, "tree7": 2.8, "tree63": 7.0}, shapes)
    assert curve["B2"] == pytest.approx(1.8) and curve["B8"] == pytest.approx(2.4)  # the line through B=4, B=16
    assert curve["tree3"] == pytest.approx(2.5) and curve["tree31"] == pytest.approx(4.6)  # by verified rows
    noisy = glue.derive_curve({"target": 1.0, "B4": 2.0, "B16": 1.5, "tree7": 0.2, "tree63": 3.0}, shapes)
    assert noisy["B2"] == noisy["B8"] == noisy["B16"] == 2.0  # a falling line taken flat, the family monotone
    assert noisy["tree3"] == noisy["tree7"] == 1.0 and noisy["tree31"] == pytest.approx(1 + 2 * 24 / 56)  # >= 1


def test_measure_curve_times_few_shapes_beside_target_steps(monkeypatch, caplog):
    """Each measured shape runs once untimed (it compiles), then in rounds, each run timed against the target steps
    just before and after it, on random prompts as long as the call's; a small cache shortens the runs."""
    seen = []
    cost = {"target": 1.0, "B2": 1.5, "B4": 2.0, "tree7": 3.0, "tree63": 6.0}

    def fake(target, drafter, prompts, *, Bk, tree, max_new_tokens, max_cache_len, **kw):
        key = Shape(Bk, tree).key
        seen.append((key, {len(p) for p in prompts}, max_new_tokens))
        assert (drafter is None) == (Bk == 1) and kw["stop_token_ids"] == []
        slow = (key, sum(k == key for k, _, _ in seen)) in {("B2", 2), ("tree63", 4)}  # the machine slow a while
        t = cost[key] * (2.0 if slow else 1.0) * 1e-3
        return types.SimpleNamespace(decode_time=t * 10, cycles=10), None

    monkeypatch.setattr(glue, "run_shape", fake)
    tgt = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
    shapes = candidate_shapes(4)
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        curve = glue.measure_curve(tgt, object(), 2, 1024, shapes, prompt_len=150, sp=None, prefill_chunk=64,
                                   rounds=3)
    assert [k for k, _, _ in seen[:5]] == ["target", "B2", "B4", "tree7", "tree63"]  # untimed: they compile
    assert [k for k, _, _ in seen[5:14]] == ["target", "B2", "target", "B4", "target", "tree7", "target", "tree63",
                                             "target"]
    assert len(seen) == 5 + 3 * 9 and all(n == {150} and new == glue.MEASURE_STEPS + 1 for _, n, new in seen)
    for k in ("B2", "B4", "tree7", "tree63"):
        assert curve[k] == pytest.approx(cost[k])  # the median round: the slow runs left out
    assert set(curve) == {s.key for s in shapes} and curve["tree3"] == pytest.approx(3.0 - 4 * 3.0 / 56)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "auto: measuring cycle costs for batch 2, cache 1024 (1 of 5: target-only) ..."
    assert msgs[-1].startswith("auto: cycle costs for batch 2, cache 1024 in ") and "tree 3 2.79*" in msgs[-1]
    seen.clear()
    glue.measure_curve(tgt, object(), 1, 128, shapes, prompt_len=500, sp=None, prefill_chunk=64, rounds=1)
    assert all(n == {128 - 64 - 16 - 1} and new == 17 for _, n, new in seen)  # 128 slots: the prompt shortened


def test_auto_is_lossless_persists_its_evidence_and_recompiles_nothing(pair, tmp_path):
    import dflash_jax as dj
    target, drafter = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    S = _cache_len(5, 20)
    key = _store_curve(target, drafter, 2, S, _dear())  # every drafted shape dear
    ref = dj.generate(target, None, prompts, max_new_tokens=20, max_cache_len=S)
    first = dj.generate(target, drafter, prompts, max_new_tokens=20, block_size="auto")
    assert first.tokens == ref.tokens and first.block_size == 4 and first.auto_look
    assert first.auto_reason.startswith("auto shape: B=4 (no acceptance seen yet") and "\n" not in first.auto_reason
    before = dict(dj.COMPILE_COUNTS)
    second = dj.generate(target, drafter, prompts, max_new_tokens=20, block_size="auto")
    assert second.tokens == ref.tokens and second.block_size == 1 and not second.auto_look
    assert second.auto_reason.startswith("auto shape: target-only (expected")  # nothing drafted pays at 50 steps
    assert second.compile_time == 0 and dj.COMPILE_COUNTS == before  # the program ref compiled
    table = json.loads((tmp_path / store.FILE).read_text())
    assert table["curves"] == {key: _dear()}  # nothing measured
    ev_key, ev = glue.evidence(target, drafter)
    assert ev.calls == 2 and ev_key.endswith(store.device_kind())
    assert table["evidence"][ev_key] == json.loads(json.dumps(dataclasses.asdict(ev)))
    glue._EVIDENCE.clear()  # a new process starts from the disk
    again = glue.evidence(target, drafter)[1]
    assert again is not ev and dataclasses.asdict(again) == json.loads(json.dumps(dataclasses.asdict(ev)))
    assert dj.generate(target, drafter, prompts, max_new_tokens=20, block_size="auto").tokens == ref.tokens


@pytest.mark.parametrize("temperature,rest", [(0.0, "target-only"), (1.0, "target-only"), (0.0, "B=2"),
                                              (1.0, "B=2")])
def test_a_look_then_the_rest_with_another_shape_is_lossless(pair, monkeypatch, temperature, rest):
    """A look runs look_tokens with its shape, the rest goes on in the same decode state with the shape chosen for
    it (target-only, or another drafted shape): one prefill for the whole call, the output target-only's, greedy and
    sampled with the same seed (own row ids); a row that stops inside the look is not continued."""
    import dflash_jax as dj
    look = 8
    monkeypatch.setattr(glue, "POLICY", AutoPolicy(look_tokens=look))
    target, drafter = pair
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 3]]
    new = 3 * look
    S = _cache_len(5, new)
    # target-only: nothing drafted pays; B=2: cheaper than a target step, so it pays even with nothing accepted
    _store_curve(target, drafter, 3, S, _dear(cheap=None if rest == "target-only" else Shape(2)))
    kw = dict(max_new_tokens=new, temperature=temperature, seed=7, row_ids=[5, 1, 9])
    ref = dj.generate(target, None, prompts, max_cache_len=S, stop_token_ids=[], **kw)
    stop = ref.tokens[2][look // 2]  # row 2 stops inside the look, the others may stop later
    ref = dj.generate(target, None, prompts, max_cache_len=S, stop_token_ids=[[], [], [stop]], **kw)
    kinds = []
    real = programs.compiled
    monkeypatch.setattr(programs, "compiled", lambda kind, *a, **k: (kinds.append(kind), real(kind, *a, **k))[1])
    got = dj.generate(target, drafter, prompts, block_size="auto", stop_token_ids=[[], [], [stop]], **kw)
    assert got.auto_reason.startswith("auto shape: B=4 (no acceptance seen yet")
    assert f"; then auto shape: {rest} (expected" in got.auto_reason and "\n" not in got.auto_reason
    assert kinds == ["prefill", "loop", "loop"]  # the look's loop, then the rest's: no second prefill
    assert got.tokens == ref.tokens
    assert len(got.tokens[0]) == new and len(got.tokens[2]) <= look // 2 + 1
    assert got.block_size == (1 if rest == "target-only" else 2)
    assert got.decode_tokens == sum(len(t) - 1 for t in got.tokens)
    assert sum(got.acceptance_lengths[0]) == new - 1 and len(got.acceptance_lengths[0]) <= got.cycles
    ev = glue.evidence(target, drafter)[1]
    assert ev.calls == 1  # one call: its look and its rest recorded as one answer


def test_the_cost_curve_is_measured_once_per_batch_and_cache(pair, monkeypatch, caplog, tmp_path):
    """The first auto call at a (batch, cache) measures the curve (progress in the log, the cache file named once per
    process); later calls there read it; another batch measures its own."""
    import dflash_jax as dj
    target, drafter = pair
    monkeypatch.setattr(glue, "MEASURE_ROUNDS", 1)
    measured = []
    real = glue.measure_curve
    monkeypatch.setattr(glue, "measure_curve", lambda t, d, b, S, *a, **k: measured.append((b, S)) or (
        real(t, d, b, S, *a, **k) if b == 1 else _dear()))  # batch 2: as measured, to save the test's time
    kw = dict(max_new_tokens=12, stop_token_ids=[])
    with caplog.at_level(logging.INFO, logger="dflash_jax"):
        for ps in ([[1, 2, 3]], [[4, 5]], [[1, 2, 3], [4, 5, 6]]):
            dj.generate(target, drafter, ps, **kw)
    S = _cache_len(3, 12)
    assert measured == [(1, S), (2, S)]
    curves = json.loads((tmp_path / store.FILE).read_text())["curves"]
    pair_key = store.pair_key(target, drafter)
    assert set(curves) == {store.curve_key(pair_key, b, S) for b in (1, 2)}
    c = curves[store.curve_key(pair_key, 1, S)]
    assert set(c) == {s.key for s in candidate_shapes(4)} and c["target"] == 1.0 and c["tree63"] >= c["tree3"] >= 1
    msgs = [r.getMessage() for r in caplog.records]
    told = [m for m in msgs if m.startswith("auto: cost curves and acceptance evidence cached in")]
    assert told == [f"auto: cost curves and acceptance evidence cached in {tmp_path / store.FILE} "
                    f"(${store.ENV_DIR})"]
    assert sum(m.startswith(f"auto: measuring cycle costs for batch 1, cache {S} (") for m in msgs) == 5
    assert sum(m.startswith("auto shape: ") for m in msgs) >= 1


def test_generate_defaults_to_auto_with_a_drafter_only(pair, monkeypatch):
    """generate()'s default shape is auto with a drafter (after the plain path's input checks); block_size None /
    an int / a tree budget fix the shape; without a drafter the default is plain target-only decoding, no curve."""
    gen = importlib.import_module("dflash_jax.decode.api")
    target, drafter = pair
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
    with pytest.raises(ValueError, match="auto"):
        gen.generate(target, drafter, prompts, max_new_tokens=4, block_size=4, tree_budget="auto")
    for bad in (dict(shadow_trees=3), dict(block_size=4, tree_budget=3, shadow_trees=3),
                dict(block_size=4, shadow_trees=0)):
        with pytest.raises(ValueError, match="shadow_trees must be tree budgets >= 1 of a chain"):
            gen.generate(target, drafter, prompts, max_new_tokens=4, **bad)

    def no_curve(*a, **k):
        raise AssertionError("cost curve measured")
    monkeypatch.setattr(glue, "measure_curve", no_curve)
    kw = dict(max_new_tokens=6, stop_token_ids=[])
    ref = gen.generate(target, None, prompts, **kw)  # no drafter: the default is target-only
    assert ref.block_size == 1 and ref.tree_budget is None and ref.auto_reason is None
    for fixed, block, tree in [(dict(block_size=None), 4, None), (dict(block_size=2), 2, None),
                               (dict(tree_budget=3), 4, 3)]:  # a tree of the drafter's depth
        r = gen.generate(target, drafter, prompts, **fixed, **kw)
        assert (r.block_size, r.tree_budget) == (block, tree) and r.tokens == ref.tokens, fixed
    assert len(calls) == n
    monkeypatch.setattr(gen, "generate_auto", real_auto)
    assert gen.generate(target, None, prompts, tree_budget="auto", **kw).tokens == ref.tokens
    with pytest.raises(ValueError, match="tree_budget needs a drafter"):
        gen.generate(target, None, prompts, tree_budget=3, **kw)


def test_processes_run_process_0s_curve_and_choices(pair, monkeypatch):
    """Multi-host: every process takes process 0's cost curve (no measuring where process 0 has one) and its choice
    (processes running different programs in one mesh would stall). Simulated: process 0's values from a stub."""
    import dflash_jax as dj
    target, drafter = pair
    shapes = candidate_shapes(4)
    zero = _dear(cheap=Shape(2))  # what process 0 holds: B=2 pays
    sent = []

    def from_0(values):
        sent.append(list(values))
        if len(values) == len(shapes):
            return [zero[s.key] for s in shapes]
        return [shapes.index(Shape(2)), 0]  # a choice: B=2, no look

    monkeypatch.setattr(store, "process_count", lambda: 2)
    monkeypatch.setattr(store, "from_process_0", from_0)
    monkeypatch.setattr(glue, "measure_curve", lambda *a, **k: pytest.fail("measured"))
    prompts = [[1, 2, 3]]
    ref = dj.generate(target, None, prompts, max_new_tokens=10, stop_token_ids=[])
    got = dj.generate(target, drafter, prompts, max_new_tokens=10, stop_token_ids=[])
    assert sent[0] == [-1.0] * len(shapes)  # this process held no curve
    assert got.block_size == 2 and got.tokens == ref.tokens
    assert got.auto_reason.startswith("auto shape: B=2 (process 0's choice; here: auto shape: B=4 (no acceptance")


def test_a_look_at_target_only_runs_the_whole_call(pair, monkeypatch):
    """A look at target-only (timing target steps) runs the whole call target-only: its decode state holds no drafter
    context for a drafted rest to go on from. The steps are recorded as the call's."""
    import dflash_jax as dj
    from dflash_jax.auto import Choice

    class Looking(AutoPolicy):
        def choose(self, ev, shapes, curve, *, context="", rest=False):
            assert not rest
            return Choice(Shape(1), 1.0, "auto shape: target-only (exploring: timing target steps)", look=True)

    monkeypatch.setattr(glue, "POLICY", Looking(look_tokens=4))
    target, drafter = pair
    prompts = [[1, 2, 3], [4, 5]]
    S = _cache_len(3, 16)
    _store_curve(target, drafter, 2, S, _dear(1.5))
    ref = dj.generate(target, None, prompts, max_new_tokens=16, max_cache_len=S, stop_token_ids=[])
    kinds = []
    real = programs.compiled
    monkeypatch.setattr(programs, "compiled", lambda kind, *a, **k: (kinds.append(kind), real(kind, *a, **k))[1])
    got = dj.generate(target, drafter, prompts, max_new_tokens=16, stop_token_ids=[])
    assert got.tokens == ref.tokens and got.block_size == 1 and got.cycles == 15 and kinds == ["prefill", "loop"]
    assert got.auto_reason == "auto shape: target-only (exploring: timing target steps)"
    assert glue.evidence(target, drafter)[1].calls == 1
