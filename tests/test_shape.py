"""The typed decode shape and its one parser, generate()'s prompt forms (token ids, arrays, a tokenizer's output,
strings) with decoded texts, one-line ValueErrors for bad arguments, and dj.load_reference()."""
from __future__ import annotations

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.decode import MAX_TREE_NODES, Auto, Chain, Shape, TargetOnly, Tree, parse_shape


# ----------------------------------------------------------------------------------------------
# parser (no models)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,want", [
    ("auto", Auto()), ("AUTO", Auto()), ("off", TargetOnly()), ("target-only", TargetOnly()), ("chain", Chain()),
    ("chain:8", Chain(8)), ("8", Chain(8)), (8, Chain(8)), (np.int64(4), Chain(4)), (None, Chain()),
    ("tree:16", Tree(16)), ("tree:16:8", Tree(16, 8)), (Tree(3), Tree(3)), (Auto(), Auto()),
])
def test_shape_parse(value, want):
    got = Shape.parse(value)
    assert got == want and Shape.parse(str(got)) == got


@pytest.mark.parametrize("kw,want", [
    (dict(), Auto()), (dict(block_size="auto"), Auto()), (dict(tree_budget="auto"), Auto()),
    (dict(block_size=None, tree_budget="auto"), Auto()), (dict(block_size=None), Chain()),
    (dict(block_size=4), Chain(4)), (dict(tree_budget=16), Tree(16)),
    (dict(block_size=8, tree_budget=16), Tree(16, 8)),
    (dict(block_size=None, tree_budget=5), Tree(5)), (dict(shape="tree:7"), Tree(7)), (dict(shape=Chain(2)), Chain(2)),
])
def test_parse_shape_reads_the_api_arguments(kw, want):
    assert parse_shape(**kw) == want


@pytest.mark.parametrize("kw,msg", [
    (dict(block_size="big"), "block_size must be an integer >= 2, None or 'auto', got 'big'"),
    (dict(block_size=1), "block_size must be an integer >= 2"),
    (dict(block_size=2.5), "block_size must be an integer >= 2"),
    (dict(block_size=True), "block_size must be an integer >= 2"),
    (dict(tree_budget=0), r"tree_budget must be an integer >= 1 \(or None for the chain\), got 0"),
    (dict(tree_budget="many"), "tree_budget must be an integer >= 1"),
    (dict(tree_budget=100000), f"tree_budget 100000 is above the most nodes a draft tree may have "
                               f"\\(MAX_TREE_NODES = {MAX_TREE_NODES}\\)"),
    (dict(block_size=4, tree_budget="auto"), "tree_budget='auto' chooses the block too"),
    (dict(shape="chain:8", block_size=4), "give shape= or block_size / tree_budget, not both"),
    (dict(shape="bush:3"), "shape must be 'auto', 'off', 'chain', 'chain:B', 'tree:N'"),
    (dict(shape=[8]), "shape must be a Shape, a string"),
    (dict(block_size=Chain(4)), "a Shape goes in shape="),
])
def test_bad_shapes_are_one_line_value_errors(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        parse_shape(**kw)
    assert "\n" not in str(e.value)


def test_resolve_fills_the_drafters_block_and_checks_it():
    assert Chain().resolve(16) == Chain(16) and Tree(8).resolve(16) == Tree(8, 16) and Auto().resolve(16) == Auto()
    assert Chain(8).resolve(None) == TargetOnly() and Auto().resolve(None) == TargetOnly()
    assert (Chain(4).block, Chain(4).tree, Tree(8, 16).block, Tree(8, 16).tree) == (4, None, 16, 8)
    assert TargetOnly().block == 1 and TargetOnly().tree is None
    with pytest.raises(ValueError, match=r"block_size must be in \[2, 8\] for this drafter, got 16"):
        Chain(16).resolve(8)
    with pytest.raises(ValueError, match="tree_budget needs a drafter"):
        Tree(4).resolve(None)
    with pytest.raises(ValueError, match="more nodes than a depth-1 tree over 8 tokens holds"):
        Tree(9, 2).resolve(4, vocab_size=8)
    assert Tree(8, 2).resolve(4, vocab_size=8) == Tree(8, 2)


# ----------------------------------------------------------------------------------------------
# generate(): shapes, prompt forms, texts (a tiny random pair)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    cfg = dj.TargetConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=256,
                          eos_token_ids=())
    target = dj.init_target(cfg, seed=0, std=0.3)
    drafter = dj.init_drafter(target, num_layers=1, block_size=4, mask_token_id=3, seed=1, target_layer_ids=(0, 1))
    return target, drafter


def test_shape_argument_matches_block_size_and_tree_budget(small):
    target, drafter = small
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    kw = dict(max_new_tokens=8, stop_token_ids=[])
    ref = dj.generate(target, None, prompts, **kw)
    for shape, old in [("chain:2", dict(block_size=2)), (Tree(5), dict(tree_budget=5)),
                       ("chain", dict(block_size=None))]:
        a = dj.generate(target, drafter, prompts, shape=shape, **kw)
        b = dj.generate(target, drafter, prompts, **old, **kw)
        assert a.tokens == b.tokens == ref.tokens and a.acceptance_lengths == b.acceptance_lengths
        assert (a.block_size, a.tree_budget) == (b.block_size, b.tree_budget)
    off = dj.generate(target, drafter, prompts, shape="off", **kw)  # a drafter given, target-only asked for
    assert off.tokens == ref.tokens and off.block_size == 1


@pytest.mark.parametrize("kw,msg", [
    (dict(block_size="big"), "block_size must be an integer"),
    (dict(tree_budget=100000), "MAX_TREE_NODES"),
    (dict(block_size=9), r"block_size must be in \[2, 4\] for this drafter, got 9"),
    (dict(shape="tree:99999"), "MAX_TREE_NODES"),
    (dict(prompts=[[1, 2], "hi"]), "prompts mix strings and token ids"),
    (dict(prompts=["hi"]), "string prompts need tokenizer="),
    (dict(prompts=[[1.5, 2]]), "prompt 0 must hold integer token ids"),
    (dict(prompts=[[[1, 2]]]), r"prompt 0 must be one sequence of token ids, got shape \(1, 2\)"),
    (dict(prompts=np.zeros((1, 2, 3), np.int32)), r"prompts must be 1-D \(one prompt\) or 2-D"),
    (dict(prompts={"ids": [[1, 2]]}), "prompts as a mapping need 'input_ids'"),
    (dict(prompts=12), "prompts must be token-id sequences"),
])
def test_bad_arguments_are_one_line_value_errors(small, kw, msg):
    target, drafter = small
    args = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, **kw}
    with pytest.raises(ValueError, match=msg) as e:
        dj.generate(target, drafter, **args)
    assert "\n" not in str(e.value)


def test_prompts_as_arrays_and_a_tokenizers_output(small):
    import jax.numpy as jnp
    target, _ = small
    kw = dict(max_new_tokens=5, stop_token_ids=[])
    ref = dj.generate(target, None, [[5, 6, 7], [8, 9, 10]], **kw).tokens
    assert dj.generate(target, None, np.array([[5, 6, 7], [8, 9, 10]]), **kw).tokens == ref
    assert dj.generate(target, None, jnp.asarray([[5, 6, 7], [8, 9, 10]]), **kw).tokens == ref
    assert dj.generate(target, None, [np.array([5, 6, 7]), jnp.asarray([8, 9, 10])], **kw).tokens == ref
    assert dj.generate(target, None, np.array([5, 6, 7]), **kw).tokens == ref[:1]  # 1-D: one prompt
    assert dj.generate(target, None, [5, 6, 7], **kw).tokens == ref[:1]  # a flat list of ids: one prompt
    # a padded batch as a tokenizer returns it (left padding): the attention mask drops the pads
    enc = {"input_ids": np.array([[0, 5, 6, 7], [8, 9, 10, 11]]),
           "attention_mask": np.array([[0, 1, 1, 1], [1, 1, 1, 1]])}
    got = dj.generate(target, None, enc, **kw).tokens
    assert got[0] == ref[0] and got[1] == dj.generate(target, None, [[8, 9, 10, 11]], **kw).tokens[0]


def test_a_transformers_batch_encoding_and_texts(tmp_path):
    """A tokenizer's BatchEncoding (not only a dict) is taken as prompts; with tokenizer= the result carries the
    decoded texts, cut before a stop token; string prompts are encoded with it."""
    from dflash_jax import text
    from dflash_jax.bench.models import build_demo_models, load_models
    t_dir, d_dir = build_demo_models(str(tmp_path), vocab_size=300)
    target, drafter = load_models(t_dir, d_dir)
    tok = text.load_tokenizer(t_dir)
    enc = tok(["What is 7 times 6?", "Hi"], padding=True)
    assert type(enc).__name__ == "BatchEncoding"
    kw = dict(max_new_tokens=6, stop_token_ids=[], block_size=None)
    ids = [text.encode_text(tok, s) for s in ("What is 7 times 6?", "Hi")]
    ref = dj.generate(target, drafter, ids, **kw)
    got = dj.generate(target, drafter, enc, tokenizer=tok, **kw)
    assert got.tokens == ref.tokens and ref.texts is None
    assert got.texts == [tok.decode(t, skip_special_tokens=True) for t in got.tokens]
    one = dj.generate(target, drafter, "What is 7 times 6?", tokenizer=tok, **kw)
    assert one.tokens[0] == dj.generate(target, drafter, [text.encode_chat(tok, "What is 7 times 6?")], **kw).tokens[0]
    assert isinstance(one.texts[0], str)


def test_generate_does_not_print(small, capsys):
    target, drafter = small
    dj.generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, shape="chain:2")
    dj.generate(target, None, [[1, 2, 3]], max_new_tokens=4)
    assert capsys.readouterr().out == ""


def test_load_reference():
    from dflash_jax.embedded import reference_paths
    if None in reference_paths():
        with pytest.raises(FileNotFoundError, match="embedded reference pair"):
            dj.load_reference()
        return
    target, drafter, tok = dj.load_reference()
    assert drafter.config.vocab_size == target.config.vocab_size and len(tok) <= target.config.vocab_size
    q = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"
    r = dj.generate(target, drafter, [q], tokenizer=tok, max_new_tokens=16, shape="chain:8")
    assert r.texts and isinstance(r.texts[0], str) and r.texts[0].strip()
    assert r.tokens == dj.generate(target, None, [q], tokenizer=tok, max_new_tokens=16).tokens
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        dj.load_reference(dtype="int8")
