"""The embedded reference pair (dflash_jax/assets/reference) and its build pipeline.

- the shipped target/drafter load (ours and transformers, same logits), tokenizer and mask token agree;
- block acceptance on held-out GSM8K test prompts (B=16, T=0): tau >= 2.5 on 10 prompts;
- greedy speculative output == target-only output token for token on 12 GSM8K test prompts (one ragged batch);
- GSM8K -> chat formatting, the typed pretraining config, and a tiny resumable pretraining run.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dflash_jax.bench.models import load_models, reference_paths
from dflash_jax.prompts import default_data_dir, read_records

T_PATH, D_PATH = reference_paths()
DATA = default_data_dir()
GSM8K_TEST = os.path.join(DATA, "gsm8k", "test.jsonl") if DATA else None
GSM8K_TRAIN = os.path.join(DATA, "gsm8k", "train.jsonl") if DATA else None
need_pair = pytest.mark.skipif(T_PATH is None or D_PATH is None, reason="no embedded reference pair "
                               "(build it with python -m train.reference)")
need_data = pytest.mark.skipif(not (GSM8K_TEST and os.path.exists(GSM8K_TEST)),
                               reason="GSM8K not found (set DFLASH_DATA_DIR)")
MAX_NEW = 192
N_FAST = 12  # prompts of the batched lossless check (a ragged batch); the first 10 give the tau check


@pytest.fixture(scope="module")
def pair():
    from dflash_jax import text
    tok = text.load_tokenizer(T_PATH)
    target, drafter = load_models(T_PATH, D_PATH, "float32")
    return tok, target, drafter


def _gsm8k_prompts(tok, n):
    from dflash_jax.prompts import load_dataset_prompts
    from dflash_jax.text import encode_chat
    return [encode_chat(tok, s.chat(0, [])) for s in load_dataset_prompts("gsm8k", DATA, n, allow_hub=False)]


def _run(pair, n):
    from dflash_jax import generate
    tok, target, drafter = pair
    prompts = _gsm8k_prompts(tok, n)
    stops = list(target.config.eos_token_ids)
    kw = dict(max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=stops)
    spec = generate(target, drafter, prompts, block_size=16, **kw)
    base = generate(target, None, prompts, **kw)
    return spec, base


@pytest.fixture(scope="module")
def fast_runs(pair):
    return _run(pair, N_FAST)


# ----------------------------------------------------------------------------------------------
# The shipped pair
# ----------------------------------------------------------------------------------------------
@need_pair
def test_shipped_pair_loads_and_is_consistent(pair):
    tok, target, drafter = pair
    tc, dc = target.config, drafter.config
    assert tc.family == "qwen3" and tc.qk_norm and tc.tie_word_embeddings
    assert tc.vocab_size >= len(tok)
    assert dc.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert dc.block_size == 16 and dc.hidden_size == tc.hidden_size
    assert all(0 <= i < tc.num_layers for i in dc.target_layer_ids)
    assert tok.convert_tokens_to_ids("<|im_end|>") in tc.eos_token_ids
    n_t = sum(int(np.prod(a.shape)) for a in __import__("jax").tree_util.tree_leaves(target.params))
    assert 1e6 < n_t < 2e7, n_t
    for d in (T_PATH, D_PATH):  # small enough to ship in the package (the target: 19.6 MiB of bf16)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        assert size < 20 * 2**20, (d, size)
    with open(os.path.join(D_PATH, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["mask_token_id"] == dc.mask_token_id


@need_pair
def test_transformers_loads_the_target_with_the_same_logits(pair):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_jax.model import target_logits
    from dflash_jax.text import encode_chat
    tok, target, _ = pair
    hf_tok = AutoTokenizer.from_pretrained(T_PATH)
    msgs = [{"role": "user", "content": "Tom has 3 apples and buys 12 more. How many apples does he have?"}]
    ids = encode_chat(tok, msgs)
    assert ids == hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False) \
        or ids == list(hf_tok(hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(T_PATH, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(target_logits(target, np.asarray([ids])))[0, :, :ref.shape[-1]]
    np.testing.assert_allclose(ours, ref, atol=2e-3 * max(1.0, float(np.abs(ref).max())))
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.98


# ----------------------------------------------------------------------------------------------
# Acceptance and losslessness on held-out GSM8K test prompts
# ----------------------------------------------------------------------------------------------
@need_pair
@need_data
def test_tau_on_gsm8k_test_b16_greedy(fast_runs):
    spec, _ = fast_runs
    lens = [x for row in spec.acceptance_lengths[:10] for x in row]
    tau = float(np.mean(lens))
    assert tau >= 2.5, f"tau {tau:.3f} on 10 GSM8K test prompts (B=16, T=0)"


@need_pair
@need_data
def test_greedy_speculative_equals_target_only(fast_runs):
    spec, base = fast_runs
    assert len(spec.tokens) == N_FAST
    for i, (a, b) in enumerate(zip(spec.tokens, base.tokens)):
        assert a == b, f"prompt {i}: speculative output differs from target-only at token " \
                       f"{next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}"
    assert sum(len(t) for t in base.tokens) > N_FAST * 20  # real answers, not immediate stops


@need_pair
@need_data
def test_tree_cycles_report_what_the_full_block_chain_commits(pair, fast_runs):
    """GenerationResult.chain_lengths (the acceptance evidence of auto shapes): in a tree cycle, what the
    chain of the drafter's full block commits in the same state - exactly, or (negative) a lower bound
    where the tree's greedy chain ends before the block's depth; and the reverse, a chain's shadow_lengths:
    what a tree would commit. Checked on the first cycle, where the chain and the trees start from the same
    state, for prompts cut inside the target's own answers (long acceptances)."""
    from dflash_jax import generate
    _, target, drafter = pair
    _, base = fast_runs
    prompts = _gsm8k_prompts(pair[0], 2)
    cut = [p + base.tokens[i][:k] for i, p in enumerate(prompts) for k in (9, 33, 50)]
    kw = dict(max_new_tokens=17, temperature=0.0, stop_token_ids=[])  # a first cycle's whole commit (16) fits
    chain = generate(target, drafter, cut, block_size=16, shadow_trees=(3, 16), **kw)
    want = [row[0] for row in chain.chain_lengths]
    assert max(want) >= 4  # long acceptances are part of the check
    exact = censored = 0
    for n in (3, 16):
        tree = generate(target, drafter, cut, tree_budget=n, **kw)
        got = [row[0] for row in tree.chain_lengths]
        for i, (w, g) in enumerate(zip(want, got)):
            assert (w == g) if g > 0 else (w >= -g >= 1), (n, i, w, g)
            exact += g > 0
            censored += g < 0
        # the chain's shadow tree of n nodes (built unverified, walked by the committed text) commits what the tree
        # run commits in its first cycle (same state)
        assert [row[0] for row in chain.shadow_lengths[n]] == [row[0] for row in tree.acceptance_lengths], n
    assert exact and censored  # both kinds were seen
    assert chain.shadow_lengths[16] != chain.shadow_lengths[3]  # the budgets differ somewhere


# ----------------------------------------------------------------------------------------------
# Build pipeline pieces (no shipped pair needed)
# ----------------------------------------------------------------------------------------------
def test_clean_solution_formats_gsm8k_answers():
    from dflash_jax.reference_data import clean_solution, gsm8k_chat
    ans = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72.\n#### 1,072"
    out = clean_solution(ans)
    assert "<<" not in out and "####" not in out
    assert out == "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72.\nThe answer is \\boxed{1072}."
    with pytest.raises(ValueError, match="####"):
        clean_solution("no final line")
    user, asst = gsm8k_chat({"question": " How many? ", "answer": "2+2=<<2+2=4>>4\n#### 4"})
    assert user["role"] == "user" and user["content"].startswith("How many?\nPlease reason step by step")
    assert asst == {"role": "assistant", "content": "2+2=4\nThe answer is \\boxed{4}."}


def test_pretrain_config_is_typed_and_strict(tmp_path):
    from dflash_jax.reference_config import load_pretrain_config
    from dflash_jax.training.schema import ConfigError
    base = {"tokenizer": {"dir": "t"}, "data": {"train": "x.jsonl"}, "checkpoint": {"dir": "c"},
            "output": {"dir": "o"}}
    cfg = load_pretrain_config(data=base, overrides=["model.num_layers=3", "optimizer.lr=1e-3"])
    assert cfg.model.num_layers == 3 and cfg.optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match="model.num_layer"):
        load_pretrain_config(data=dict(base, model={"num_layer": 2}))
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_pretrain_config(data=base, overrides=["train.step=3"])
    with pytest.raises(ConfigError, match="missing required key 'output.dir'"):
        load_pretrain_config(data={k: v for k, v in base.items() if k != "output"})
    with pytest.raises(ConfigError, match="expected an integer"):
        load_pretrain_config(data=base, overrides=["model.hidden_size=big"])
    repo_cfg = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "reference_target.yaml")
    assert load_pretrain_config(repo_cfg).tokenizer.vocab_size == 2048


@pytest.mark.skipif(not (GSM8K_TRAIN and os.path.exists(GSM8K_TRAIN)), reason="GSM8K not found")
def test_tiny_pretraining_runs_resumes_and_exports(tmp_path):
    from dflash_jax.model import target_logits
    from dflash_jax.weights import load_target
    from dflash_jax.reference import pretrain
    from dflash_jax.reference_config import load_pretrain_config
    from dflash_jax.reference_data import encode_example
    from dflash_jax.text import load_tokenizer
    rows = read_records(GSM8K_TRAIN)[:48]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"tokenizer": {"dir": str(tmp_path / "tok"), "vocab_size": 400},
            "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
                      "num_kv_heads": 1, "head_dim": 16},
            "data": {"train": str(train), "eval": str(train), "eval_rows": 8, "max_length": 512},
            "train": {"batch_size": 8, "steps": 6, "length_buckets": [512]},
            "optimizer": {"lr": 3e-3},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 3, "async_save": False},
            "log": {"every_steps": 3, "sample_prompts": 0},
            "output": {"dir": str(tmp_path / "out"), "dtype": "float32"}}
    cfg = load_pretrain_config(data=data)
    s1 = pretrain(cfg, log=lambda *_: None, progress=False)
    assert s1["start_step"] == 0 and s1["steps"] == 6
    hist = [json.loads(x) for x in open(tmp_path / "ckpt" / "metrics.jsonl")]
    losses = [h["loss"] for h in hist if h["split"] == "train"]
    assert len(losses) == 2 and losses[1] < losses[0]  # it learns
    tok = load_tokenizer(str(tmp_path / "out"))
    assert tok.convert_tokens_to_ids("<|mask|>") == 3
    ids, plen = encode_example(tok, rows[0])
    tgt = load_target(str(tmp_path / "out"))
    assert np.isfinite(np.asarray(target_logits(tgt, np.asarray([ids])))).all()
    # rerun: resumes at the last checkpoint (step 6 of 6) and trains nothing more
    s2 = pretrain(cfg, log=lambda *_: None, progress=False)
    assert s2["start_step"] == 6
    # a changed trajectory is refused
    from dflash_jax.training.schema import ConfigError
    with pytest.raises(ConfigError, match="different settings"):
        pretrain(load_pretrain_config(data=data, overrides=["optimizer.lr=1e-2"]), log=lambda *_: None,
                 progress=False)
