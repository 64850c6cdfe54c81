"""Shared by the CLI tests: running a command-line tool as a subprocess, and the tiny pair they use (a
random Qwen3 target with a BPE tokenizer trained on GSM8K questions, and a random drafter)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_jax import text
from dflash_jax.config import TargetConfig
from dflash_jax.drafter import init_drafter
from dflash_jax.model import init_target
from dflash_jax.weights import save_drafter, save_target

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
BLOCK = 8


def run(*args, timeout=600, cwd=REPO, env=None):
    """`python -m *args` on the CPU; `env`: more environment variables."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=env)
    return r


def ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r.stdout


def make_pair(root):
    """(target dir, drafter dir) under `root`: the tiny Qwen3 target + tokenizer and a random drafter."""
    tdir, ddir = root / "target", root / "drafter"
    tok = text.build_demo_tokenizer(str(tdir), text.demo_corpus(str(DATA) if DATA.is_dir() else None, 300),
                                    vocab_size=512)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = TargetConfig(family="qwen3", vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, tie_word_embeddings=False,
                       eos_token_ids=(eos,))
    target = init_target(cfg, seed=0)
    save_target(target, str(tdir))
    drafter = init_drafter(target, num_layers=2, block_size=BLOCK, mask_token_id=tok.convert_tokens_to_ids("<|mask|>"),
                           seed=1, target_layer_ids=(0, 2))
    save_drafter(drafter, str(ddir))
    return str(tdir), str(ddir)
