"""Typed configuration for drafter training: a dataclass tree loaded from YAML plus dotted overrides.

    cfg = load_config("configs/qwen3_8b_v5p8.yaml", ["optimizer.lr=3e-4", "train.steps=100"])

The sections, their defaults and the cross-field checks live here; the loading rules (unknown keys
rejected with a hint, values converted to the declared types, `section.key=value` overrides, required
keys) are schema.py's:
- every YAML key must name a field; an unknown key is a `ConfigError` naming its full dotted path
  (`train.num_anchor` -> "unknown key 'train.num_anchor' (did you mean 'train.num_anchors'?)");
- values are converted to the field's declared type; a value that does not convert is an error naming the key;
- overrides `a.b=value` use the same conversion (`3e-4` is a float for a float field);
- required keys (no default) that are still missing after overrides are an error.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional

import yaml

from .schema import MISSING, ConfigError, build_section, check_required, parse_overrides, set_override


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RandomTargetConfig:
    """Build a random target (and a small byte-level BPE tokenizer) at `target.path` when it does
    not exist yet - for tests and the tiny CPU config. Not used for real models."""
    family: Literal["qwen3", "llama", "qwen2"] = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    std: float = 0.02
    seed: int = 0
    tokenizer_vocab_size: int = 384  # demo byte-level BPE trained on a little text (<= vocab_size)


@dataclasses.dataclass
class TargetSection:
    path: str = MISSING  # HF directory (or hub id when online)
    dtype: str = "bfloat16"  # weights/activations of the frozen target
    quant: Optional[str] = None  # "int8" / "fp8": the target's weights when it generates the training data
    kv_quant: Optional[str] = None  # "int8" / "fp8": its KV cache there
    tokenizer: Optional[str] = None  # default: target.path
    random_init: Optional[RandomTargetConfig] = None


@dataclasses.dataclass
class DrafterSection:
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int = -1  # required (Qwen3: 151669)
    target_layer_ids: Optional[list[int]] = None  # default: DFlash's round(1 + i*(N-4)/(n-1))
    init_from: Optional[str] = None  # an existing z-lab drafter directory to continue from
    layer_types: Optional[list[str]] = None  # e.g. ["full_attention", "sliding_attention", ...]
    sliding_window: Optional[int] = None
    init_std: float = 0.02
    seed: int = 0
    kind: Literal["dflash", "dflash2"] = "dflash"  # dflash2: dynamic convs + candidate selector (DFlash2DraftModel)
    conv_kernel_size: int = 2  # dflash2 only, as the rest of this section
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16


@dataclasses.dataclass
class GenerationSection:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 2048  # per response; also capped by data.max_length - prompt length
    batch_size: int = 32  # slots: rows decoding at once (continuous batching), global over the local devices
    refill: Optional[int] = None  # prompts prefilled per refill, per data shard (default slots per shard // 4)
    shard_size: Optional[int] = None  # sequences per data shard file (default batch_size)
    seed: int = 0
    stop_token_ids: Optional[list[int]] = None  # default: tokenizer eos + config/generation_config eos


@dataclasses.dataclass
class DataSection:
    prompts: str = MISSING  # JSONL/JSON file, or a hub data set name (needs `datasets` + network)
    split: str = "train"  # hub split
    subset: Optional[str] = None  # hub config name
    field: Optional[str] = None  # prompt field; default: first of prompt/question/problem/instruction/...
    prompt_format: Literal["chat", "raw", "ids"] = "chat"  # chat template / plain text / token-id lists
    system_prompt: Optional[str] = None
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)  # e.g. {enable_thinking: false}
    output_dir: str = MISSING
    max_length: int = 3072  # prompt + response tokens kept per sequence
    min_response_tokens: int = 2  # prompts leaving less room than this are skipped
    max_prompts: Optional[int] = None
    generation: GenerationSection = dataclasses.field(default_factory=GenerationSection)


@dataclasses.dataclass
class TrainSection:
    num_anchors: int = 512  # blocks per sequence (fewer when the response is shorter)
    gamma: Optional[float] = None  # loss decay; default by block size: 7 / 5 / 4 for B = 16 / 10 / 8
    batch_size: int = 16  # sequences per micro-batch (global, split over mesh.data)
    grad_accum: int = 1  # micro-batches per optimizer step
    epochs: int = 6
    steps: Optional[int] = None  # optimizer steps; overrides epochs when set
    seed: int = 0
    compute_dtype: str = "bfloat16"  # drafter activations / matmuls
    param_dtype: str = "float32"  # master weights and optimizer state
    loss_chunk: int = 64  # anchors per logits/CE chunk (bounds the [anchors, B-1, vocab] logits)
    length_buckets: Optional[list[int]] = None  # padded sequence lengths; default 64 * 1.125^k (x16) up to max_length
    anchor_chunk: Optional[int] = None  # anchors per attention chunk in each drafter layer (null = all at once)
    remat: Literal["none", "layer", "chunk", "layer_dots"] = "none"  # jax.checkpoint of drafter layers / chunks
    selector_weight: float = 1.0  # dflash2 drafters: alpha, the weight of the selector's K-way cross entropy
    zero1: bool = True  # optimizer state and gradients sharded over mesh.data (params stay replicated)
    length_grouping: int = 64  # steps per length-sorted window (similar lengths batched together); 0 = random


@dataclasses.dataclass
class OptimizerSection:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    final_lr_ratio: float = 0.0  # end of the decay, as a fraction of lr
    weight_decay: float = 0.0  # AdamW decoupled decay on matrices (norm weights are not decayed)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global-norm gradient clipping (0 = off)


@dataclasses.dataclass
class CheckpointSection:
    dir: str = MISSING  # local path or gs://... (handed to orbax unchanged)
    every_steps: int = 1000
    keep_last: int = 3
    async_save: bool = True


@dataclasses.dataclass
class EvalSection:
    every_steps: int = 1000  # 0 = only at the start and the end
    num_sequences: int = 64  # held out from training (the last ones by prompt index)
    batch_size: Optional[int] = None  # default: train.batch_size
    num_anchors: Optional[int] = None  # default: train.num_anchors
    generate_prompts: int = 0  # > 0: also run speculative generate() on that many held-out prompts
    generate_max_new_tokens: int = 128


@dataclasses.dataclass
class MeshSection:
    data: Optional[int] = None  # None = all devices / model
    model: int = 1


@dataclasses.dataclass
class LogSection:
    metrics_path: Optional[str] = None  # default: <checkpoint.dir>/metrics.jsonl (local dirs only)
    tensorboard_dir: Optional[str] = None  # written only when tensorboardX or tensorflow is installed
    every_steps: int = 10
    progress_bar: bool = True


@dataclasses.dataclass
class ExportSection:
    dir: Optional[str] = None  # default: <checkpoint.dir>/export (z-lab HF format)
    dtype: str = "bfloat16"


@dataclasses.dataclass
class TrainConfig:
    target: TargetSection = dataclasses.field(default_factory=TargetSection)
    drafter: DrafterSection = dataclasses.field(default_factory=DrafterSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    export: ExportSection = dataclasses.field(default_factory=ExportSection)

    # ---- derived values ----
    @property
    def gamma(self) -> float:
        return self.train.gamma if self.train.gamma is not None else default_gamma(self.drafter.block_size)

    @property
    def metrics_path(self) -> str | None:
        if self.log.metrics_path:
            return self.log.metrics_path
        if "://" in self.checkpoint.dir:
            return None
        return os.path.join(self.checkpoint.dir, "metrics.jsonl")

    @property
    def export_dir(self) -> str:
        return self.export.dir or join_path(self.checkpoint.dir, "export")

    @property
    def tokenizer_path(self) -> str:
        return self.target.tokenizer or self.target.path

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def join_path(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name if "://" in base else os.path.join(base, name)


_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """DFlash's loss decay: 7 for B=16, 5 for B=10, 4 for B=8; piecewise-linear between those
    (B/2 below 8, slope 1/3 above 16)."""
    pts = _GAMMA_POINTS
    if block_size <= pts[0][0]:
        return block_size / 2.0
    if block_size >= pts[-1][0]:
        return pts[-1][1] + (block_size - pts[-1][0]) / 3.0
    for (b0, g0), (b1, g1) in zip(pts, pts[1:]):
        if b0 <= block_size <= b1:
            return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    raise AssertionError


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that do not need the model."""
    check_required(cfg)
    d, t, o = cfg.drafter, cfg.train, cfg.optimizer

    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    need(d.mask_token_id >= 0, "drafter.mask_token_id is required (a reserved/unused token id of the target; "
                               "Qwen3: 151669)")
    need(d.block_size >= 2, f"drafter.block_size must be >= 2, got {d.block_size}")
    need(d.num_layers >= 1, f"drafter.num_layers must be >= 1, got {d.num_layers}")
    need(t.num_anchors >= 1, f"train.num_anchors must be >= 1, got {t.num_anchors}")
    need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    need(t.grad_accum >= 1, f"train.grad_accum must be >= 1, got {t.grad_accum}")
    need(t.steps is None or t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    need(t.steps is not None or t.epochs >= 1, f"train.epochs must be >= 1, got {t.epochs}")
    need(t.loss_chunk >= 1, f"train.loss_chunk must be >= 1, got {t.loss_chunk}")
    need(cfg.gamma > 0, f"train.gamma must be > 0, got {cfg.gamma}")
    need(t.selector_weight >= 0, f"train.selector_weight must be >= 0, got {t.selector_weight}")
    need(o.lr > 0, f"optimizer.lr must be > 0, got {o.lr}")
    need(0 <= o.warmup_ratio < 1, f"optimizer.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
    need(o.clip_norm >= 0, f"optimizer.clip_norm must be >= 0, got {o.clip_norm}")
    need(cfg.checkpoint.every_steps >= 1, f"checkpoint.every_steps must be >= 1, got {cfg.checkpoint.every_steps}")
    need(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")
    need(cfg.eval.every_steps >= 0, f"eval.every_steps must be >= 0, got {cfg.eval.every_steps}")
    need(cfg.eval.num_sequences >= 0, f"eval.num_sequences must be >= 0, got {cfg.eval.num_sequences}")
    need(cfg.data.max_length >= 4, f"data.max_length must be >= 4, got {cfg.data.max_length}")
    need(cfg.data.min_response_tokens >= 2, "data.min_response_tokens must be >= 2 (an anchor and a label)")
    need(cfg.data.generation.batch_size >= 1, "data.generation.batch_size must be >= 1")
    g = cfg.data.generation
    need(g.refill is None or 1 <= g.refill <= g.batch_size,
         f"data.generation.refill must be in [1, batch_size={g.batch_size}] or null, got {g.refill}")
    need(g.shard_size is None or g.shard_size >= 1, f"data.generation.shard_size must be >= 1 or null, got {g.shard_size}")
    need(cfg.data.generation.max_new_tokens >= 1, "data.generation.max_new_tokens must be >= 1")
    need(cfg.data.max_prompts is None or cfg.data.max_prompts >= 1, "data.max_prompts must be >= 1 or null")
    need(cfg.mesh.model >= 1, f"mesh.model must be >= 1, got {cfg.mesh.model}")
    need(cfg.mesh.data is None or cfg.mesh.data >= 1, f"mesh.data must be >= 1 or null, got {cfg.mesh.data}")
    for name in ("compute_dtype", "param_dtype"):
        v = getattr(t, name)
        need(v in ("float32", "bfloat16", "float16"), f"train.{name} must be float32/bfloat16/float16, got {v!r}")
    need(cfg.target.dtype in ("float32", "bfloat16", "float16"),
         f"target.dtype must be float32/bfloat16/float16, got {cfg.target.dtype!r}")
    for name in ("quant", "kv_quant"):
        v = getattr(cfg.target, name)
        need(v in (None, "int8", "fp8"), f"target.{name} must be int8, fp8 or null, got {v!r}")
    need(cfg.export.dtype in ("float32", "bfloat16", "float16"),
         f"export.dtype must be float32/bfloat16/float16, got {cfg.export.dtype!r}")
    need(t.anchor_chunk is None or t.anchor_chunk >= 1, f"train.anchor_chunk must be >= 1 or null, got {t.anchor_chunk}")
    need(t.length_grouping >= 0, f"train.length_grouping must be >= 0 (0 = off), got {t.length_grouping}")
    if t.length_buckets:
        need(all(b >= 2 for b in t.length_buckets), "train.length_buckets must be >= 2")


def config_from_dict(data: dict | None, overrides=(), source: str = "<dict>") -> TrainConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        cfg = build_section(TrainConfig, data)
    except ConfigError as e:  # the file's own keys and values: name the file
        raise ConfigError(f"{source}: {e}") from None
    overrides = parse_overrides(overrides)
    for k, v in overrides:  # errors name the override, not the file
        set_override(cfg, k, v)
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}{' with overrides' if overrides else ''}: {e}") from None
    return cfg


def load_config(path: str, overrides=()) -> TrainConfig:
    """Read a YAML config, apply `section.key=value` overrides, validate."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return config_from_dict(data, overrides, source=path)
