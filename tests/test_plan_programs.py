"""The planner's decode programs at the shapes that matter beyond the basics of tests/test_plan.py: quantized targets,
the training plan, serving batches, the concurrency curve, hybrid and Gemma 4 targets (a file of its own so that
xdist runs it beside test_plan.py)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from dflash_jax import planner as pl
from tests.test_plan import ROOT, TINY, needs_libtpu, tiny  # noqa: F401 - tiny is a fixture


@needs_libtpu
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_targets_read_fewer_bytes(tiny, mode):
    """1-byte weights and KV cache (dflash_jax.quant) on a data=2 x model=2 mesh, a cache filled to 4000 of 4096
    slots: the step's compiled HBM traffic and its physical minimum fall to under 0.6x the bf16 step's (the scales
    and the bf16 embeddings stay), the Pallas cache kernel compiles with the scales, and the programs fit."""
    kw = dict(mesh="data=2,model=2", drafter_layers=1, block_size=4, batch=2, prompt_len=3900, max_new_tokens=100,
              cache_len=4096, prefill=False, largest_batch=False, cost_method="full")
    base = {p["name"]: p for p in pl.plan(tiny, "v5p-8", **kw)["programs"]}
    rep = pl.plan(tiny, "v5p-8", quant=mode, kv_quant=mode, **kw)
    assert rep["quant"] == mode and rep["kv_quant"] == mode and f"(weights {mode})" in pl.markdown_table([rep])
    q = {p["name"]: p for p in rep["programs"]}
    assert q["cycle"]["fits"] and q["cycle"]["argument_bytes"] < base["cycle"]["argument_bytes"]  # drafter: bf16
    assert q["target_step"]["argument_bytes"] < 0.6 * base["target_step"]["argument_bytes"]
    step, b = q["target_step"], base["target_step"]
    assert step["min_bytes"] < 0.6 * b["min_bytes"] and step["hbm_bytes"] < 0.6 * b["hbm_bytes"], (step, b)
    assert step["hbm_bytes"] >= step["min_bytes"]


@needs_libtpu
def test_plan_train_uses_the_trainers_memory_options_and_costs_every_anchor(tmp_path):
    """The training step the planner compiles is the one the pipeline runs (ZeRO shardings, anchor
    chunks, remat): sharding the AdamW state over data=4 shrinks the per-chip arguments; the flops of
    the loop-free extrapolation grow with the anchors (a loop body costed once would not)."""
    cfg = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    common = ["train.batch_size=8", "train.grad_accum=2", "train.anchor_chunk=16", "train.remat=chunk",
              "data.max_length=128"]
    z = pl.plan_train(cfg, "v5p-8", overrides=common + ["train.num_anchors=32"])
    t, rec = z["train"], z["programs"][0]
    assert rec["fits"] and t["per_chip"] == 2 and t["sequences_per_step"] == 16
    assert 0 < t["hbm_spare_fraction"] < 1 and rec["min_bytes"] > 0
    assert rec["flops"] > 0 and rec["roofline_seconds"] > 0 and "extended to 32" in rec["cost_method"]
    assert 0 < t["mfu_at_roofline"] <= 1.0 and t["sequences_per_second"] > 0 and t["compiled_over_model_flops"] > 0.5
    text = pl.format_report(z)
    assert "2 per chip" in text and "% spare" in text and "implied MFU" in text
    no_zero = pl.plan_train(cfg, "v5p-8", overrides=common + ["train.num_anchors=32", "train.zero1=false"], cost=False)
    assert no_zero["programs"][0]["argument_bytes"] > rec["argument_bytes"]
    pts = rec["flops_at_anchors"]  # the loop-free variants at 16 and 32 anchors: the drafter's work grows with them
    assert sorted(pts) == [16, 32] and pts[32] > 1.2 * pts[16], pts
    assert rec["flops"] == pytest.approx(2 * pts[32], rel=1e-6)  # 32 anchors = the second point, x grad_accum 2


# KV heads x head dim of a real model (8 x 128: Qwen3-8B, Llama-3.1-8B), the rest small: the cache layout the TPU
# compiler picks for a one-slot update depends on these
WIDE_KV = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
               head_dim=128, vocab_size=1024)


@needs_libtpu
def test_large_batch_programs_stay_in_place(tmp_path):
    """Serving batches (64 rows per chip, where the KV writes of a one-token step once went through a loop whose
    cache layout the compiler changed, converting the whole cache around every layer): the target-only step and
    the B=16 cycle write their caches in place. Their traffic that grows with the cache is the filled KV read
    once (two caches, the same fill past a fixed gap: the difference in HBM bytes equals the difference in
    min_bytes), the step reads no more than 1.1x its minimum, and temporaries stay far below the cache."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump(WIDE_KV, f)
    rows = 64
    reps = [pl.plan(str(tmp_path), "v5p-8", batch=4 * rows, prompt_len=S - 248, max_new_tokens=200, cache_len=S,
                    drafter_layers=1, block_size=16, prefill=False, largest_batch=False, cost_method="full")
            for S in (1024, 2048)]
    small, large = ({p["name"]: p for p in r["programs"]} for r in reps)
    cache_bytes = 3 * 2 * rows * 8 * 2048 * 128 * 2  # K and V of 2 target + 1 drafter layers, bf16, per chip
    for name in ("target_step", "cycle"):
        a, b = small[name], large[name]
        assert a["fits"] and b["fits"], (a, b)
        grew, must = b["hbm_bytes"] - a["hbm_bytes"], b["min_bytes"] - a["min_bytes"]
        assert must > 0 and abs(grew - must) <= 0.1 * must, (name, grew, must)
        assert b["temp_bytes"] <= cache_bytes / 16, (name, b["temp_bytes"], cache_bytes)
    assert large["target_step"]["hbm_bytes"] <= 1.1 * large["target_step"]["min_bytes"], large["target_step"]


@needs_libtpu
def test_concurrency_curve(tiny, tmp_path, monkeypatch):
    """python -m infer.plan_curve's library part: per cache and rows per chip, the step time and cycle / step for
    each shape, written as JSON, markdown and a PNG."""
    from dflash_jax import concurrency
    res = concurrency.curve(tiny, "v5p-8", rows_per_chip=(1, 8), caches=(1152,), blocks=(4,), trees=(), drafter_layers=1,
                            largest=False)
    pts = res["points"]
    assert [(p["cache"], p["rows_per_chip"], p["batch"]) for p in pts] == [(1152, 1, 4), (1152, 8, 32)]
    for p in pts:
        assert p["fits"] and p["step_ms"] > 0 and set(p["ratios"]) == {"B=4"} and p["ratios"]["B=4"] > 1.0
    assert pts[1]["step_ms"] > pts[0]["step_ms"]  # 8 rows per chip read more KV than 1
    partial = concurrency.write_partial(res, str(tmp_path / "curve"))  # as an interrupted run leaves it
    previous = concurrency.read_partial(str(tmp_path / "curve"))

    def no_compile(*a, **k):
        raise AssertionError("a point of the earlier run was compiled again")

    monkeypatch.setattr(pl, "plan", no_compile)
    again = concurrency.curve(tiny, "v5p-8", rows_per_chip=(1, 8), caches=(1152,), blocks=(4,), trees=(),
                              drafter_layers=1, largest=False, previous=previous)
    assert again["points"] == pts
    with pytest.raises(pl.PlanError, match="other settings"):
        concurrency.curve(tiny, "v5p-8", rows_per_chip=(1,), caches=(1152,), blocks=(8,), trees=(), largest=False,
                          previous=previous)
    paths = concurrency.write(res, str(tmp_path / "curve"))
    assert not os.path.exists(partial)
    md = open(paths["md"]).read()
    assert "| 8 | 32 |" in md and "B=4" in md
    assert os.path.getsize(paths["png"]) > 1000
    with pytest.raises(pl.PlanError, match="too short"):
        concurrency.curve(tiny, "v5p-8", caches=(512,), largest=False)


def test_concurrency_table_tells_a_program_that_does_not_fit_from_one_not_compiled():
    """curve's markdown: a cycle compiled that does not fit reads "no fit", a shape not compiled (past the biggest
    block's last fitting batch) "-", a point whose target step does not fit says so."""
    from dflash_jax import concurrency
    res = {"tpu": "v5p-8", "dtype": "bfloat16", "blocks": [4, 16], "trees": [16], "points": [
        {"cache": 4096, "rows_per_chip": 8, "batch": 32, "fits": True, "step_ms": 9.0, "ratios": {"B=4": 1.2},
         "hbm_over_min": {"step": 1.01}, "no_fit": ["B=16"]},
        {"cache": 4096, "rows_per_chip": 16, "batch": 64, "fits": False}]}
    md = concurrency.markdown(res)
    assert "| 8 | 32 | 9 | 1.01 | 1.20 | no fit | - |" in md, md
    assert "| 16 | 64 | step does not fit |" in md, md


HYBRID = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 512,
          "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
          "linear_key_head_dim": 32, "linear_value_head_dim": 32, "full_attention_interval": 4,
          "max_position_embeddings": 4096, "eos_token_id": 1,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}


@needs_libtpu
@pytest.mark.parametrize("tpu,mesh", [("v5p-8", None), ("v6e-8", "data=2,model=4")])
def test_hybrid_target_programs_compile_and_count_the_recurrent_state(tmp_path, tpu, mesh):
    """A Gated DeltaNet hybrid (3 linear + 1 full layer): the step, the chain and the tree cycle compile for the TPU
    (heads over the model axis on v6e-8), and min_bytes = weights + the attention layers' KV + the recurrent state
    read and written once."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump(HYBRID, f)
    rep = pl.plan(str(tmp_path), tpu, mesh=mesh, batch=8, prompt_len=100, max_new_tokens=20, cache_len=256,
                  drafter_layers=1, block_size=8, tree_budgets=(16,), prefill=False, largest_batch=False, cost=False)
    names = [p["name"] for p in rep["programs"]]
    assert {"target_step", "cycle", "tree_cycle"} <= set(names), names
    assert all(p["fits"] for p in rep["programs"]), rep["programs"]
    tcfg = pl.load_target_config(str(tmp_path), "bfloat16")
    sl = pl.resolve_tpu(tpu)
    d, m = (4, 1) if mesh is None else (2, 4)
    dec = pl.DecodePrograms(pl.DecodeSetup(tcfg, None, pl.make_mesh(pl.topology_devices(sl), d, m), 8, 100, 20, 256))
    target, _ = dec.models(1, "stacked")
    rows = 8 // d
    state = 3 * rows * ((8 // m) * 32 * 32 * 4 + 3 * (2 * 4 * 32 + 8 * 32) // m * 2)  # 3 GDN layers, f32 S, bf16 conv
    kv = 2 * 1 * rows * max(2 // m, 1) * 32 * 121 * 2  # 1 attention layer, K and V: 120 filled + 1 new slot
    head = pl.bytes_per_chip(target.params)
    emb = target.params["embed"]
    weights = head - pl.bytes_per_chip(emb) + rows * 128 * 2  # the lookup reads one embedding row per token
    assert dec.min_bytes("cycle", 1) == weights + kv + 2 * state
    assert rep["recurrent_state_bytes_per_chip"] == state
    assert "recurrent state (Gated DeltaNet layers" in pl.format_report(rep)


GEMMA4 = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "global_head_dim": 64, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "sliding_window": 64, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
          "max_position_embeddings": 4096, "eos_token_id": 1, "tie_word_embeddings": True,
          "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}


@needs_libtpu
@pytest.mark.parametrize("mesh", [None, "data=1,model=4"])
def test_gemma4_target_programs_compile_and_count_kv_per_kind(tmp_path, mesh):
    """A Gemma 4 target (3 sliding + 1 full layer, each kind its own head size and KV heads): the step and the
    chain cycle compile for v5p-8 (heads over the model axis, KV heads replicated, at model 4), and min_bytes =
    weights + each kind's KV, the sliding layers reading at most their window."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump(GEMMA4, f)
    rep = pl.plan(str(tmp_path), "v5p-8", mesh=mesh, batch=8, prompt_len=100, max_new_tokens=20, cache_len=256,
                  drafter_layers=1, block_size=8, prefill=False, largest_batch=False, cost=False)
    names = [p["name"] for p in rep["programs"]]
    assert {"target_step", "cycle"} <= set(names), names
    assert all(p["fits"] for p in rep["programs"]), rep["programs"]
    tcfg = pl.load_target_config(str(tmp_path), "bfloat16")
    d, m = (4, 1) if mesh is None else (1, 4)
    dec = pl.DecodePrograms(pl.DecodeSetup(tcfg, None, pl.make_mesh(pl.topology_devices(pl.resolve_tpu("v5p-8")), d, m),
                                           8, 100, 20, 256))
    target, _ = dec.models(1, "stacked")
    rows = 8 // d
    assert target.params["layers"][3]["k"].shape[0] == 64 * max(1, m)  # the full layers' one KV head, replicated
    sliding = 2 * 3 * rows * max(2 // m, 1) * 32 * (64 + 1) * 2  # K and V, 3 layers: the window of 64 + 1 new slot
    full = 2 * 1 * rows * 1 * 64 * (120 + 1) * 2  # 1 layer: 120 filled + 1 new slot
    assert dec.min_bytes("cycle", 1) == pl.bytes_per_chip(target.params) + sliding + full


def test_gemma4_layer_period_is_its_attention_pattern(tmp_path):
    """The 'layers' cost method extends by the sliding / full pattern, and not at all with KV-shared last layers."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(GEMMA4, num_hidden_layers=8, layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2),
                  f)
    tc = pl.load_target_config(str(tmp_path), "bfloat16")
    assert pl.layer_period(tc) == 4
    assert pl.layer_period(dataclasses.replace(tc, gemma4=dataclasses.replace(tc.gemma4, kv_shared_layers=2))) is None


@needs_libtpu
def test_short_block_cycle_writes_the_drafter_cache_in_place(tmp_path):
    """A B=4 cycle (a block shorter than the drafter's 16) appends 4 context rows per row: with the drafter's layers
    in a loop its context cache was a loop carry the compiler re-laid out, a copy of the drafter's K and V in the
    temporaries (5 GiB per chip at 64 rows, Qwen3-8B); the appends now run layer by layer on the cache in place."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(WIDE_KV, num_hidden_layers=4), f)
    rows, S, layers = 16, 1024, 2
    rep = pl.plan(str(tmp_path), "v5p-8", batch=4 * rows, prompt_len=S - 248, max_new_tokens=200, cache_len=S,
                  drafter_layers=layers, block_size=16, block_sizes=(4,), prefill=False, target_step=False,
                  largest_batch=False, cost=False)
    cyc = next(p for p in rep["programs"] if p["name"] == "cycle")
    drafter_cache = 2 * layers * rows * 8 * S * 128 * 2  # K and V, bf16, per chip
    assert cyc["fits"] and cyc["temp_bytes"] <= drafter_cache / 4, (cyc["temp_bytes"], drafter_cache)
