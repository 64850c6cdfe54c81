"""Typed YAML training configs: shipped configs, unknown keys, overrides with type conversion, errors."""
from __future__ import annotations

import os

import pytest
import yaml

from dflash_jax.training.config import config_from_dict, default_gamma, load_config
from dflash_jax.training.schema import ConfigError
from dflash_jax.training.testing import tiny_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_shipped_configs_load():
    q = load_config(os.path.join(ROOT, "configs/qwen3_8b_v5p8.yaml"))
    assert q.target.path == "Qwen/Qwen3-8B" and q.drafter.mask_token_id == 151669
    assert q.drafter.block_size == 16 and q.drafter.num_layers == 5 and q.gamma == 7.0
    assert q.train.num_anchors == 512 and q.optimizer.lr == 6e-4 and q.optimizer.warmup_ratio == 0.04
    assert q.checkpoint.dir.startswith("gs://")
    ll = load_config(os.path.join(ROOT, "configs/llama31_8b_b10.yaml"))
    assert ll.target.path == "meta-llama/Llama-3.1-8B-Instruct" and ll.drafter.block_size == 10
    assert ll.gamma == 5.0 and ll.drafter.mask_token_id == 128002
    t = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"))
    assert t.target.random_init is not None and t.target.random_init.hidden_size == 64
    assert t.gamma == default_gamma(t.drafter.block_size) == 4.0


def test_default_gamma():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(4) == 2.0 and 5.0 < default_gamma(12) < 7.0 and default_gamma(19) == 8.0


def test_unknown_yaml_key_names_full_path(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    d["train"]["num_anchor"] = 3
    with pytest.raises(ConfigError, match=r"unknown key 'train\.num_anchor'.*did you mean 'train\.num_anchors'"):
        load_config(_write(tmp_path, d))
    d = tiny_config_dict(str(tmp_path))
    d["data"]["generation"]["temprature"] = 0.5
    with pytest.raises(ConfigError, match=r"unknown key 'data\.generation\.temprature'"):
        config_from_dict(d)
    d = tiny_config_dict(str(tmp_path))
    d["trian"] = {}
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*did you mean 'train'"):
        config_from_dict(d)
    d = tiny_config_dict(str(tmp_path))
    d["target"]["random_init"]["hidden"] = 3
    with pytest.raises(ConfigError, match=r"target\.random_init\.hidden"):
        config_from_dict(d)


def test_overrides_convert_by_field_type(tmp_path):
    p = _write(tmp_path, tiny_config_dict(str(tmp_path)))
    cfg = load_config(p, ["optimizer.lr=3e-4", "train.steps=100", "train.gamma=2.5", "drafter.target_layer_ids=[0, 2]",
                          "log.progress_bar=false", "train.steps=120", "data.max_prompts=null",
                          "data.generation.temperature=1", "checkpoint.dir=gs://bucket/run",
                          "data.chat_template_kwargs={enable_thinking: false}", "target.tokenizer=007",
                          "export.dir=null"])
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.train.steps == 120 and isinstance(cfg.train.steps, int)
    assert cfg.gamma == 2.5
    assert cfg.drafter.target_layer_ids == [0, 2]
    assert cfg.log.progress_bar is False
    assert cfg.data.max_prompts is None
    assert cfg.data.generation.temperature == 1.0 and isinstance(cfg.data.generation.temperature, float)
    assert cfg.checkpoint.dir == "gs://bucket/run" and cfg.export_dir == "gs://bucket/run/export"
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.target.tokenizer == "007"
    # YAML values convert too ("6e-4" is a string to YAML 1.1, a float for a float field)
    d = tiny_config_dict(str(tmp_path))
    d["optimizer"]["lr"] = "6e-4"
    d["train"]["steps"] = 10.0
    cfg = config_from_dict(d)
    assert cfg.optimizer.lr == 6e-4 and cfg.train.steps == 10


@pytest.mark.parametrize("override, pattern", [
    ("optimizer.learning_rate=1", r"unknown key 'optimizer\.learning_rate'"),
    ("nosuch.lr=1", r"unknown key 'nosuch'"),
    ("train.steps=abc", r"train\.steps: expected an integer"),
    ("train.steps=1.5", r"train\.steps: expected an integer"),
    ("log.progress_bar=maybe", r"log\.progress_bar: expected true/false"),
    ("optimizer.schedule=step", r"optimizer\.schedule: 'step' is not one of"),
    ("train.num_anchors", r"not of the form section\.key=value"),
    ("optimizer.lr.x=1", r"'optimizer\.lr' is not a section"),
    ("train=3", r"'train' is a section"),
    ("train.batch_size=0", r"train\.batch_size must be >= 1"),
    ("target.quant=int4", r"target\.quant must be int8, fp8 or null"),
    ("train.steps=null", None),  # allowed: epochs take over
])
def test_bad_overrides(tmp_path, override, pattern):
    p = _write(tmp_path, tiny_config_dict(str(tmp_path)))
    if pattern is None:
        assert load_config(p, [override]).train.steps is None
        return
    with pytest.raises(ConfigError, match=pattern):
        load_config(p, [override])


def test_override_of_a_key_in_another_section_names_it_and_not_the_file(tmp_path):
    p = _write(tmp_path, tiny_config_dict(str(tmp_path)))
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.lr=3e-4"])
    msg = str(e.value)
    assert msg == "override 'train.lr=3e-4': unknown key 'train.lr' (did you mean 'optimizer.lr'?)"
    assert p not in msg  # the YAML file is fine: the override is what is wrong
    with pytest.raises(ConfigError, match=r"^override 'train\.num_anchor=3': unknown key 'train\.num_anchor' "
                                          r"\(did you mean 'train\.num_anchors'\?\)"):
        load_config(p, ["train.num_anchor=3"])


def test_missing_and_invalid_values(tmp_path):
    d = tiny_config_dict(str(tmp_path))
    del d["checkpoint"]["dir"]
    with pytest.raises(ConfigError, match=r"missing required key 'checkpoint\.dir'"):
        config_from_dict(d)
    d = tiny_config_dict(str(tmp_path))
    del d["drafter"]["mask_token_id"]
    with pytest.raises(ConfigError, match=r"drafter\.mask_token_id is required"):
        config_from_dict(d)
    d = tiny_config_dict(str(tmp_path))
    d["train"]["batch_size"] = "many"
    with pytest.raises(ConfigError, match=r"train\.batch_size: expected an integer"):
        config_from_dict(d)
    d = tiny_config_dict(str(tmp_path))
    d["train"] = [1, 2]
    with pytest.raises(ConfigError, match=r"expected a mapping for section 'train'"):
        config_from_dict(d)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))


def test_config_round_trips_through_yaml(tmp_path):
    cfg = config_from_dict(tiny_config_dict(str(tmp_path)), ["train.gamma=3"])
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
