"""Public API limits: max_new_tokens capped at the model's context, draft_logits takes one sequence."""
from __future__ import annotations

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.config import TargetConfig
from dflash_jax.decode.state import capped_new_tokens


@pytest.fixture(scope="module")
def small():
    cfg = TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=40, eos_token_ids=())
    target = dj.init_target(cfg, seed=0)
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=3, seed=1, target_layer_ids=(0, 1))
    return target, drafter


def test_max_new_tokens_is_capped_by_max_position_embeddings(small):
    target, drafter = small
    prompt = list(range(5, 15))  # 10 tokens: 30 positions left
    with pytest.warns(UserWarning, match=r"max_new_tokens 100000 capped to 30: a prompt of 10 tokens"):
        r = dj.generate(target, drafter, [prompt], max_new_tokens=100_000, stop_token_ids=[], block_size=None)
    assert len(r.tokens[0]) == 30
    with pytest.warns(UserWarning):
        ref = dj.generate(target, None, [prompt], max_new_tokens=100_000, stop_token_ids=[])
    assert ref.tokens == r.tokens
    assert capped_new_tokens(40, 10, 7) == 7
    with pytest.raises(ValueError, match="fills the model's context"):
        dj.generate(target, None, [list(range(40))], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        dj.generate(target, None, [[1] * 41], max_new_tokens=4)


def test_sampling_rejects_nan_and_inf_temperature(small):
    target, _ = small
    for t in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            dj.generate(target, None, [[1, 2, 3]], max_new_tokens=2, temperature=t)


def test_draft_logits_takes_one_sequence(small):
    target, drafter = small
    logits = dj.draft_logits(target, drafter, [5, 6, 7, 8])
    assert logits.shape == (3, 64)
    with pytest.raises(ValueError, match=r"prefix_ids must be one sequence of token ids \(1-D\), got shape \(2, 4\)"):
        dj.draft_logits(target, drafter, np.array([[5, 6, 7, 8], [1, 2, 3, 4]]))
