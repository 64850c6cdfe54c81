"""The models a benchmark runs: the embedded reference pair (`reference_paths`, from dflash_jax.embedded), a tiny
random demo pair, a target / drafter pair loaded from directories, and random-weight targets of a named or
Hugging Face shape for the micro benchmarks.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from .. import text as textlib
from ..embedded import REFERENCE_DIR, reference_paths  # noqa: F401 (the CLIs' model resolution)

# Qwen3-0.6B's shape (random weights are used; only the shape matters for timing).
QWEN3_0P6B = dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                  num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, qk_norm=True, max_position_embeddings=40960)
TINY = dict(family="qwen3", vocab_size=4096, hidden_size=128, intermediate_size=256, num_layers=4,
            num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            tie_word_embeddings=True, qk_norm=True, max_position_embeddings=4096)
BENCH_CONFIGS = {"qwen3-0.6b": QWEN3_0P6B, "tiny": TINY}


def build_demo_models(out_dir: str, data_dir: str | None = None, seed: int = 0, hidden: int = 64,
                      layers: int = 4, drafter_layers: int = 2, block_size: int = 8,
                      vocab_size: int = 1024) -> tuple[str, str]:
    """A tiny random Qwen3 target (with a trained BPE tokenizer in its directory) and a random
    drafter, written under `out_dir`/target and `out_dir`/drafter. Outputs are gibberish."""
    from ..config import TargetConfig
    from ..drafter import init_drafter
    from ..model import init_target
    from ..weights import save_drafter, save_target

    tdir, ddir = os.path.join(out_dir, "target"), os.path.join(out_dir, "drafter")
    tok = textlib.build_demo_tokenizer(tdir, textlib.demo_corpus(data_dir), vocab_size=vocab_size)
    vocab = -(-len(tok) // 64) * 64
    eos = tuple(textlib.stop_token_ids(tok)) + (tok.convert_tokens_to_ids("<|endoftext|>"),)
    cfg = TargetConfig(family="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rope_theta=1e6,
                       tie_word_embeddings=False, qk_norm=True, max_position_embeddings=8192,
                       eos_token_ids=tuple(dict.fromkeys(eos)))
    target = init_target(cfg, seed=seed)
    save_target(target, tdir)
    taps = tuple(sorted({max(0, min(layers - 1, round(x))) for x in np.linspace(1, layers - 1, drafter_layers)}))
    drafter = init_drafter(target, num_layers=drafter_layers, block_size=block_size,
                           mask_token_id=tok.convert_tokens_to_ids("<|mask|>"), seed=seed + 1, target_layer_ids=taps)
    save_drafter(drafter, ddir)
    return tdir, ddir


def demo_banner() -> str:
    line = "!" * 78
    return (f"{line}\n!! DEMO MODE: no --target given and no embedded reference model found.\n"
            f"!! Using a tiny RANDOMLY INITIALISED Qwen3 target + random drafter + toy tokenizer:\n"
            f"!! the generated text is gibberish and the drafter never learns anything (tau ~ 1).\n"
            f"!! Pass --target /path/to/model [--drafter /path/to/drafter] for real output.\n{line}")


def load_models(target_path: str, drafter_path: str | None, dtype: str = "float32", mesh=None,
                quant: str | None = None, kv_quant: str | None = None, drafter_quant: str | None = None):
    """(target, drafter or None) from their directories (or hub ids); `quant` / `kv_quant`: the target's weights /
    KV cache in int8 or fp8, `drafter_quant` the drafter's weights (dflash_jax.quant)."""
    from ..weights import load_drafter, load_target
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    target = load_target(target_path, dtype=dtype, mesh=mesh, quant=quant, kv_quant=kv_quant)
    drafter = load_drafter(drafter_path, target, dtype=dtype, mesh=mesh, quant=drafter_quant) if drafter_path else None
    return target, drafter


def bench_target_config(name: str = "qwen3-0.6b", layers: int | None = None, vocab_size: int | None = None,
                        dtype: str = "float32"):
    """A benchmark target's config: a name of BENCH_CONFIGS, or a Hugging Face config.json (its directory
    or the file, e.g. configs/models/qwen3-8b: the shape of a real model, with random weights)."""
    from ..config import TargetConfig, read_config_json
    if name in BENCH_CONFIGS:
        cfg = TargetConfig(dtype=dtype, **BENCH_CONFIGS[name])
    elif os.path.exists(name):
        cfg = TargetConfig.from_hf(read_config_json(name), dtype=dtype)
    else:
        raise ValueError(f"unknown config {name!r}: not one of {', '.join(BENCH_CONFIGS)}, nor a config.json "
                         f"or a directory holding one")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return cfg


def drafter_taps(num_target_layers: int, n: int) -> tuple[int, ...]:
    """The target layers an `n`-layer random drafter taps: the default spread, or the first n when that
    does not fit the target."""
    from ..config import default_target_layer_ids
    ids = default_target_layer_ids(num_target_layers, n)
    if all(0 <= i < num_target_layers for i in ids) and len(set(ids)) == len(ids):
        return ids
    return tuple(range(min(n, num_target_layers)))


def tree_bytes(tree) -> int:
    """Bytes of a pytree's arrays."""
    import jax
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, length)).tolist()
