"""The reference target's pretraining config (configs/reference_target.yaml): a typed dataclass tree
loaded with the same machinery as drafter training (unknown keys rejected, dotted overrides, required keys).

    cfg = load_pretrain_config("configs/reference_target.yaml", ["model.num_layers=3"])
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from .training.config import CheckpointSection, OptimizerSection
from .training.schema import MISSING, ConfigError, build_section, check_required, parse_overrides, set_override


@dataclasses.dataclass
class TokenizerSection:
    dir: str = MISSING  # where the tokenizer (and later the target) is written
    vocab_size: int = 2048
    split_digits: bool = True


@dataclasses.dataclass
class ModelSection:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    init_std: float = 0.02
    seed: int = 0


@dataclasses.dataclass
class LMDataSection:
    train: str = MISSING  # GSM8K train JSONL (question, answer)
    eval: Optional[str] = None  # held-out JSONL for the eval loss and sample generations (GSM8K test)
    eval_rows: int = 64
    max_length: int = 512  # longer examples are dropped
    max_rows: Optional[int] = None


@dataclasses.dataclass
class LMTrainSection:
    batch_size: int = 32  # sequences per micro-batch
    grad_accum: int = 1
    epochs: int = 4
    steps: Optional[int] = None  # overrides epochs
    seed: int = 0
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    length_buckets: list[int] = dataclasses.field(default_factory=lambda: [128, 192, 256, 320, 384, 512])


@dataclasses.dataclass
class LMLogSection:
    every_steps: int = 25
    eval_every_steps: int = 0  # 0 = only at the end
    sample_prompts: int = 3  # greedy generations on held-out questions at the end
    sample_max_new_tokens: int = 200


@dataclasses.dataclass
class LMOutputSection:
    dir: str = MISSING  # HF directory of the trained target (config.json, model.safetensors, tokenizer)
    dtype: str = "bfloat16"


@dataclasses.dataclass
class PretrainConfig:
    tokenizer: TokenizerSection = dataclasses.field(default_factory=TokenizerSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: LMDataSection = dataclasses.field(default_factory=LMDataSection)
    train: LMTrainSection = dataclasses.field(default_factory=LMTrainSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=lambda: OptimizerSection(
        lr=2e-3, warmup_ratio=0.03, weight_decay=0.1))
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    log: LMLogSection = dataclasses.field(default_factory=LMLogSection)
    output: LMOutputSection = dataclasses.field(default_factory=LMOutputSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate_pretrain(cfg: PretrainConfig) -> None:
    check_required(cfg)

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)
    m, t = cfg.model, cfg.train
    need(cfg.tokenizer.vocab_size >= 300, f"tokenizer.vocab_size must be >= 300 (256 bytes + merges), "
                                          f"got {cfg.tokenizer.vocab_size}")
    need(m.num_heads % m.num_kv_heads == 0, f"model.num_heads {m.num_heads} is not a multiple of "
                                            f"model.num_kv_heads {m.num_kv_heads}")
    need(m.num_layers >= 1 and m.hidden_size >= 8, "model.num_layers >= 1 and model.hidden_size >= 8 required")
    need(t.batch_size >= 1 and t.grad_accum >= 1, "train.batch_size and train.grad_accum must be >= 1")
    need(t.steps is None or t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    need(t.steps is not None or t.epochs >= 1, f"train.epochs must be >= 1, got {t.epochs}")
    need(bool(t.length_buckets) and max(t.length_buckets) >= cfg.data.max_length,
         f"the largest train.length_buckets entry must be >= data.max_length ({cfg.data.max_length})")
    for name in ("compute_dtype", "param_dtype"):
        need(getattr(t, name) in ("float32", "bfloat16"), f"train.{name} must be float32 or bfloat16")
    need(cfg.output.dtype in ("float32", "bfloat16"), "output.dtype must be float32 or bfloat16")


def load_pretrain_config(path: str | None = None, overrides=(), data: dict | None = None) -> PretrainConfig:
    """configs/reference_target.yaml (or `data`) + dotted overrides -> a validated PretrainConfig."""
    import yaml
    if data is None:
        if path is None:
            raise ConfigError("no config given")
        if not os.path.exists(path):
            raise ConfigError(f"config file {path} does not exist")
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        cfg = build_section(PretrainConfig, data)
        for k, v in parse_overrides(overrides):
            set_override(cfg, k, v)
        validate_pretrain(cfg)
    except ConfigError as e:
        raise ConfigError(f"{path or '<dict>'}: {e}") from None
    return cfg
