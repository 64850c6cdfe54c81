"""Random-anchor blocks: anchor rules, labels, the block visibility rule (exhaustively, by gradients, and
behaviourally), training forward == inference forward, the weighted loss, batch schedule, mismatches."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import TargetConfig, draft_logits, init_drafter, init_target, save_drafter
from dflash_jax.drafter import draft_hidden_train
from dflash_jax.training.blocks import (BatchSchedule, build_batch, default_buckets, eval_batches, padding_fraction,
                                       sample_anchors)
from dflash_jax.training.config import config_from_dict
from dflash_jax.training.data import SequenceData
from dflash_jax.training.records import DataError
from dflash_jax.training.schema import ConfigError
from dflash_jax.training.loss import DrafterObjective, block_labels, position_weights, target_features
from dflash_jax.model import forward, init_cache
from dflash_jax.training.loss import block_logits as _block_logits
from dflash_jax.training.testing import tiny_config_dict

BK = 4
MASK = 1
block_logits = jax.jit(_block_logits)


@pytest.fixture(scope="module")
def models():
    cfg = TargetConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    target = init_target(cfg, seed=1, std=0.1)
    drafter = init_drafter(target, num_layers=2, block_size=BK, mask_token_id=MASK, seed=2, target_layer_ids=[1, 3],
                           std=0.1)
    return target, drafter


def _batch(tokens, anchors, lengths=None, valid=None):
    tokens = np.atleast_2d(np.asarray(tokens, np.int32))
    anchors = np.atleast_2d(np.asarray(anchors, np.int32))
    lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32) if lengths is None else np.asarray(lengths, np.int32)
    valid = np.ones(anchors.shape, bool) if valid is None else np.asarray(valid, bool)
    return {"tokens": jnp.asarray(tokens), "lengths": jnp.asarray(lengths), "anchor_pos": jnp.asarray(anchors),
            "anchor_valid": jnp.asarray(valid)}


# ----------------------------------------------------------------------------------------------
# Anchors and labels
# ----------------------------------------------------------------------------------------------
def test_sample_anchors_rules():
    for plen, length, A in [(5, 40, 8), (5, 9, 8), (3, 5, 100), (10, 11, 4), (10, 10, 4), (0, 30, 29)]:
        a = sample_anchors(plen, length, A, seed=0, epoch=0, seq_id=7)
        n = max(length - 1 - plen, 0)
        assert len(a) == min(A, n)
        assert len(set(a.tolist())) == len(a) and np.all(np.diff(a) > 0)
        if len(a):
            assert a.min() >= plen and a.max() <= length - 2  # in the response, a token follows
    a1 = sample_anchors(5, 200, 16, 0, 0, 7)
    assert np.array_equal(a1, sample_anchors(5, 200, 16, 0, 0, 7))  # deterministic
    assert not np.array_equal(a1, sample_anchors(5, 200, 16, 0, 1, 7))  # fresh each epoch
    assert not np.array_equal(a1, sample_anchors(5, 200, 16, 0, 0, 8))  # per sequence
    assert not np.array_equal(a1, sample_anchors(5, 200, 16, 1, 0, 7))  # per seed
    # every candidate is eventually used
    seen = set()
    for e in range(40):
        seen |= set(sample_anchors(5, 30, 4, 0, e, 0).tolist())
    assert seen == set(range(5, 29))


def test_build_batch_and_labels():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 90, size=n).tolist() for n in (20, 13, 30)]
    data = SequenceData.from_lists(seqs, [6, 10, 4], ids=[11, 12, 13])
    b = build_batch(data, [2, -1, 0, 1], T=32, num_anchors=6, seed=3, epoch=1)
    assert b["tokens"].shape == (4, 32) and b["anchor_pos"].shape == (4, 6)
    assert not b["anchor_valid"][1].any() and b["lengths"][1] == 0  # padding row
    assert b["anchor_valid"][3].sum() == 2  # 13 tokens, prompt 10: anchors 10, 11 only
    labels, valid = (np.asarray(x) for x in block_labels(jnp.asarray(b["tokens"]), jnp.asarray(b["lengths"]),
                                                         jnp.asarray(b["anchor_pos"]), 5))
    for r, i in enumerate([2, -1, 0, 1]):
        if i < 0:
            continue
        s = seqs[i]
        want = sample_anchors(data.prompt_lens[i], len(s), 6, 3, 1, data.ids[i])
        assert np.array_equal(b["anchor_pos"][r, :len(want)], want)
        for a in range(len(want)):
            p = want[a]
            for k in range(1, 5):
                assert valid[r, a, k - 1] == (p + k < len(s))
                if p + k < len(s):
                    assert labels[r, a, k - 1] == s[p + k]


# ----------------------------------------------------------------------------------------------
# Visibility rule
# ----------------------------------------------------------------------------------------------
def test_block_visibility_rule_by_gradients(models):
    """For every block a and row i: d h[a, i] / d feats[t] != 0 exactly when t < anchor_a (context strictly
    before the anchor), and h[a, i] depends on its own anchor token's embedding and the mask embedding but
    not on any other block's anchor token."""
    target, drafter = models
    rng = np.random.default_rng(0)
    T = 24
    tokens = rng.integers(10, 96, size=(1, T)).astype(np.int32)
    anchors = np.array([[2, 7, 12, 20]], np.int32)
    tokens[0, anchors[0]] = [40, 41, 42, 43]  # distinct anchor tokens, none equal to the mask or elsewhere
    tokens[0, ~np.isin(np.arange(T), anchors[0])] = rng.integers(50, 96, size=T - 4)
    feats = target_features(target, jnp.asarray(tokens), drafter.config.target_layer_ids)
    anchor_tokens = jnp.asarray(tokens[:, anchors[0]])
    A = anchors.shape[1]
    proj = jnp.asarray(rng.normal(size=(1, A, BK, 32)).astype(np.float32))

    @jax.jit
    def grads(sel, feats, embed):
        def f(feats, embed):
            tgt = target.replace(params={**target.params, "embed": embed})
            h = draft_hidden_train(drafter, tgt, feats, anchor_tokens, jnp.asarray(anchors), BK)
            return jnp.sum(h * proj * sel)
        return jax.grad(f, argnums=(0, 1))(feats, embed)

    for a in range(A):
        for i in range(BK):
            sel = np.zeros((1, A, BK, 1), np.float32)
            sel[0, a, i] = 1
            gf, ge = grads(jnp.asarray(sel), feats, target.params["embed"])
            gf = np.abs(np.asarray(gf[0])).sum(-1)  # [T]
            ge = np.abs(np.asarray(ge)).sum(-1)  # [V]
            p = anchors[0, a]
            assert np.all(gf[:p] > 0), (a, i, gf)
            assert np.all(gf[p:] == 0), (a, i, gf)
            assert ge[tokens[0, p]] > 0 and ge[MASK] > 0
            for b in range(A):
                if b != a:
                    assert ge[tokens[0, anchors[0, b]]] == 0, (a, i, b)


def test_block_isolation_behaviour(models):
    """A block's logits do not change when tokens after its anchor, or other blocks, change; they do
    change when the context before the anchor changes."""
    target, drafter = models
    rng = np.random.default_rng(1)
    T = 28
    tokens = rng.integers(4, 96, size=(1, T)).astype(np.int32)
    anchors = np.array([[3, 9, 15, 22]], np.int32)
    ref = np.asarray(block_logits(drafter, target, _batch(tokens, anchors)))
    for a in range(4):
        p = anchors[0, a]
        t2 = tokens.copy()
        t2[0, p + 1:] = rng.integers(4, 96, size=T - p - 1)  # everything after the anchor
        out = np.asarray(block_logits(drafter, target, _batch(t2, anchors)))
        np.testing.assert_allclose(out[0, a], ref[0, a], rtol=1e-5, atol=1e-5)
        if a < 3:
            assert np.abs(out[0, 3] - ref[0, 3]).max() > 1e-3  # later blocks did see the change
    # other blocks moved / invalidated: block 1 unchanged
    moved = np.array([[5, 9, 17, 25]], np.int32)
    out = np.asarray(block_logits(drafter, target, _batch(tokens, moved)))
    np.testing.assert_allclose(out[0, 1], ref[0, 1], rtol=1e-5, atol=1e-5)
    out = np.asarray(block_logits(drafter, target, _batch(tokens, anchors, valid=[[False, True, False, False]])))
    np.testing.assert_allclose(out[0, 1], ref[0, 1], rtol=1e-5, atol=1e-5)
    # another sequence in the batch does not leak in
    other = rng.integers(4, 96, size=(1, T)).astype(np.int32)
    out = np.asarray(block_logits(drafter, target, _batch(np.concatenate([other, tokens]),
                                                          np.concatenate([anchors[:, ::-1], anchors]))))
    np.testing.assert_allclose(out[1], ref[0], rtol=1e-5, atol=1e-5)
    # context before the anchor matters
    t3 = tokens.copy()
    t3[0, 1] = (t3[0, 1] + 1) % 96
    out = np.asarray(block_logits(drafter, target, _batch(t3, anchors)))
    assert np.abs(out[0, 0] - ref[0, 0]).max() > 1e-3


def test_training_forward_equals_inference(models):
    target, drafter = models
    rng = np.random.default_rng(2)
    T = 30
    tokens = rng.integers(4, 96, size=(1, T)).astype(np.int32)
    anchors = np.array([[1, 6, 13, 26]], np.int32)
    train = np.asarray(block_logits(drafter, target, _batch(tokens, anchors)))
    for a, p in enumerate(anchors[0]):
        inf = np.asarray(draft_logits(target, drafter, tokens[0, :p + 1].tolist()))
        assert inf.shape == train[0, a].shape == (BK - 1, 96)
        np.testing.assert_allclose(train[0, a], inf, rtol=1e-4, atol=1e-4)
        assert np.array_equal(train[0, a].argmax(-1), inf.argmax(-1))


# ----------------------------------------------------------------------------------------------
# Loss and metrics
# ----------------------------------------------------------------------------------------------
def test_weighted_loss_and_metrics_match_numpy(models):
    target, drafter = models
    rng = np.random.default_rng(3)
    T = 26
    tokens = rng.integers(4, 96, size=(2, T)).astype(np.int32)
    lengths = np.array([26, 19], np.int32)
    anchors = np.array([[3, 8, 17, 24], [2, 9, 15, 17]], np.int32)
    valid = np.array([[True, True, True, True], [True, False, True, True]])
    batch = _batch(tokens, anchors, lengths, valid)
    gamma = 2.0
    obj = DrafterObjective(drafter.config, gamma, loss_chunk=3)  # 4 anchors in chunks of 3: padding path
    loss, sums = jax.jit(obj.loss)(drafter.params, target, batch)
    m = obj.summarize(jax.tree_util.tree_map(np.asarray, sums))

    logits = np.asarray(block_logits(drafter, target, batch), np.float64)
    w = np.exp(-np.arange(BK - 1) / gamma)
    num = den = 0.0
    lead, nblocks = [], 0
    correct = np.zeros(BK - 1)
    count = np.zeros(BK - 1)
    for r in range(2):
        for a in range(4):
            if not valid[r, a]:
                continue
            nblocks += 1
            run = True
            n_lead = 0
            for k in range(1, BK):
                pos = anchors[r, a] + k
                if pos >= lengths[r]:
                    run = False
                    continue
                lab = tokens[r, pos]
                lg = logits[r, a, k - 1]
                ce = np.log(np.exp(lg - lg.max()).sum()) + lg.max() - lg[lab]
                num += w[k - 1] * ce
                den += w[k - 1]
                ok = lg.argmax() == lab
                correct[k - 1] += ok
                count[k - 1] += 1
                run = run and ok
                n_lead += run
            lead.append(n_lead)
    assert abs(float(loss) - num / den) < 1e-4
    assert abs(m["loss"] - num / den) < 1e-4
    assert abs(m["tau"] - (1 + np.mean(lead))) < 1e-6
    assert m["blocks"] == nblocks
    for k in range(1, BK):
        assert abs(m[f"acc_{k}"] - correct[k - 1] / count[k - 1]) < 1e-6
    np.testing.assert_allclose(position_weights(BK, gamma), w, rtol=1e-6)
    assert position_weights(16, 7.0)[0] == 1.0 and abs(position_weights(16, 7.0)[7] - np.exp(-1)) < 1e-6


def test_perfect_predictions_give_full_acceptance(models):
    """tau = 1 + leading correct positions: a drafter that is always right reaches B."""
    from dflash_jax.training.loss import block_metrics_sums, summarize_block_sums
    K = BK - 1
    valid = jnp.ones((1, 2, K), bool)
    av = jnp.ones((1, 2), bool)
    ce = jnp.zeros((1, 2, K))
    all_ok = summarize_block_sums(block_metrics_sums(ce, jnp.ones((1, 2, K), bool), valid, av, jnp.ones((K,))))
    assert all_ok["tau"] == BK and all_ok["acc"] == 1.0
    first_wrong = jnp.asarray([[[False, True, True], [True, False, True]]])
    m = summarize_block_sums(block_metrics_sums(ce, first_wrong, valid, av, jnp.ones((K,))))
    assert m["tau"] == 1 + (0 + 1) / 2


def test_memory_options_keep_loss_and_gradients(models):
    """Anchor chunks (context K/V once per layer) and jax.checkpoint variants change memory, not math."""
    target, drafter = models
    rng = np.random.default_rng(4)
    tokens = rng.integers(4, 96, size=(2, 26)).astype(np.int32)
    anchors = np.array([[3, 8, 17, 24, 5], [2, 9, 15, 17, 20]], np.int32)
    valid = np.array([[True, True, True, True, False], [True, False, True, True, True]])
    batch = _batch(tokens, anchors, np.array([26, 21], np.int32), valid)

    def run(**kw):
        obj = DrafterObjective(drafter.config, 2.0, loss_chunk=3, **kw)
        (loss, _), g = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))(drafter.params, target, batch)
        return float(loss), jax.tree_util.tree_leaves(g)

    base_loss, base_g = run()
    for kw in (dict(anchor_chunk=2, remat="chunk"), dict(anchor_chunk=3, remat="layer_dots")):
        loss, g = run(**kw)
        np.testing.assert_allclose(loss, base_loss, rtol=1e-5)
        for a, b in zip(g, base_g):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    with pytest.raises(ValueError, match="remat must be one of"):
        run(remat="everything")


def test_target_stops_after_last_tap(models):
    from dflash_jax.training.loss import target_features, truncate_target
    target, _ = models
    tokens = jnp.asarray(np.random.default_rng(5).integers(4, 96, size=(2, 12)), jnp.int32)
    short = truncate_target(target, 3)
    assert short.config.num_layers == 3 and short.params["layers"]["q"].shape[0] == 3
    _, _, full = forward(target, tokens, init_cache(target, 2, 12), (0, 2))
    np.testing.assert_allclose(target_features(target, tokens, (0, 2)), full, rtol=1e-6, atol=1e-6)
    jaxpr = jax.make_jaxpr(lambda t: target_features(t, tokens, (0, 2)))(target)
    assert [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"] == [3]  # layers 0..2 only


# ----------------------------------------------------------------------------------------------
# Schedule
# ----------------------------------------------------------------------------------------------
def test_batch_schedule_epochs():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 90, size=int(n)).tolist() for n in rng.integers(12, 60, size=23)]
    data = SequenceData.from_lists(seqs, [4] * 23)
    s = BatchSchedule(data, batch_size=4, grad_accum=2, num_anchors=5, seed=0, buckets=[32, 64])
    assert s.steps_per_epoch == 2  # 23 // 8, tail dropped
    e0 = np.concatenate([s.rows(0).ravel(), s.rows(1).ravel()])
    e1 = np.concatenate([s.rows(2).ravel(), s.rows(3).ravel()])
    assert len(set(e0.tolist())) == 16 and len(set(e1.tolist())) == 16  # no repeats within an epoch
    assert not np.array_equal(e0, e1)
    b = s.batch(3)
    assert b["tokens"].shape[:2] == (2, 4) and b["tokens"].shape[2] in (32, 64)
    again = BatchSchedule(data, 4, 2, 5, 0, [32, 64]).batch(3)
    assert all(np.array_equal(b[k], again[k]) for k in b)  # rebuilt from the step number alone
    with pytest.raises(DataError, match="fewer than one optimizer step"):
        BatchSchedule(data, batch_size=16, grad_accum=2, num_anchors=5, seed=0, buckets=[64])
    with pytest.raises(DataError, match="largest length bucket"):
        BatchSchedule(data, batch_size=4, grad_accum=1, num_anchors=5, seed=0, buckets=[16])
    ev = eval_batches(data, 5, 5, 0, [32, 64], multiple=2)
    assert all(x["tokens"].shape[0] == 6 for x in ev)
    assert sum(int((x["lengths"] > 0).sum()) for x in ev) == 23


def test_length_grouped_schedule_pads_less_and_covers_each_sequence_once():
    rng = np.random.default_rng(1)
    lens = np.clip(rng.normal(200, 60, size=300), 80, 400).astype(int)  # GSM8K-like: 84..605, median 196
    data = SequenceData.from_lists([np.ones(int(n), np.int32) for n in lens], [8] * 300)
    buckets = default_buckets(400)
    assert buckets[0] == 32 and buckets[-1] == 400 and all(b % 16 == 0 for b in buckets)
    assert all(b1 / b0 <= 1.125 + 16 / b0 for b0, b1 in zip(buckets, buckets[1:]))
    rand = BatchSchedule(data, 8, 2, 4, 0, buckets)
    grp = BatchSchedule(data, 8, 2, 4, 0, buckets, group_steps=18)
    assert grp.steps_per_epoch == rand.steps_per_epoch == 18
    for epoch in (0, 1):
        rows = np.concatenate([grp.rows(epoch * 18 + j).ravel() for j in range(18)])
        assert len(set(rows.tolist())) == 288  # each sequence at most once per epoch
        # one window of 18 steps: the epoch's sequences (as without grouping), steps shuffled
        step_max = [lens[grp.rows(epoch * 18 + j).ravel()].max() for j in range(18)]
        assert sorted(rows.tolist()) == sorted(rand._perm(epoch)[:288].tolist())
        assert step_max != sorted(step_max)
    pr = padding_fraction(rand.batch(i) for i in range(18))
    pg = padding_fraction(grp.batch(i) for i in range(18))
    assert pg < 0.1 < pr, (pg, pr)
    again = BatchSchedule(data, 8, 2, 4, 0, buckets, group_steps=18)
    assert all(np.array_equal(grp.batch(20)[k], again.batch(20)[k]) for k in again.batch(20))


# ----------------------------------------------------------------------------------------------
# Drafter / target mismatches
# ----------------------------------------------------------------------------------------------
def test_drafter_target_mismatch_errors(tmp_path, models):
    from dflash_jax.training.pipeline import drafter_config
    target, drafter = models
    tc = target.config
    base = tiny_config_dict(str(tmp_path))
    cfg = config_from_dict(base, ["drafter.target_layer_ids=[1, 7]"])
    with pytest.raises(ValueError, match=r"does not match the target.*target_layer_ids \[7\] out of range"):
        drafter_config(cfg, tc, "float32")
    cfg = config_from_dict(base, ["drafter.mask_token_id=500"])
    with pytest.raises(ValueError, match=r"mask_token_id 500 outside the target vocabulary"):
        drafter_config(cfg, tc, "float32")
    path = str(tmp_path / "d")
    save_drafter(drafter, path)
    cfg = config_from_dict(base, [f"drafter.init_from={path}", "drafter.num_layers=2", "drafter.mask_token_id=1"])
    with pytest.raises(ConfigError, match=r"drafter\.block_size=8 but .* has 4"):
        drafter_config(cfg, tc, "float32")
    cfg = config_from_dict(base, [f"drafter.init_from={path}", "drafter.num_layers=2", "drafter.mask_token_id=1",
                                  f"drafter.block_size={BK}"])
    assert drafter_config(cfg, tc, "float32").block_size == BK
    other = dataclasses.replace(tc, hidden_size=48, num_heads=4, head_dim=12)
    with pytest.raises(ValueError, match=r"hidden_size 32 != target's 48"):
        drafter_config(cfg, other, "float32")
