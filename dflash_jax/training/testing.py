"""Small, fast training setups for tests and smoke runs (random tiny targets, token-id prompts)."""
from __future__ import annotations

import copy
import json
import os
import signal
import time

import numpy as np


def write_id_prompts(path: str, n: int, seed: int = 0, lo: int = 4, hi: int = 300, min_len: int = 6,
                     max_len: int = 14, field: str = "ids") -> str:
    """A JSONL file of `n` random token-id prompts (for data.prompt_format=ids)."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            k = int(rng.integers(min_len, max_len + 1))
            f.write(json.dumps({field: rng.integers(lo, hi, size=k).tolist()}) + "\n")
    return path


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def tiny_config_dict(root: str, **sections) -> dict:
    """A complete config for a random 4-layer target (hidden 64, vocab 320) with token-id prompts under
    `root` (prompts at root/prompts.jsonl - write them with `write_id_prompts`). Keyword arguments are
    merged into the sections, e.g. `train={"steps": 50}`."""
    base = {
        "target": {"path": f"{root}/target", "dtype": "float32",
                   "random_init": {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4,
                                   "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "std": 0.02, "seed": 0,
                                   "tokenizer_vocab_size": 300}},
        "drafter": {"num_layers": 1, "block_size": 8, "mask_token_id": 3, "target_layer_ids": [1, 3]},
        "data": {"prompts": f"{root}/prompts.jsonl", "field": "ids", "prompt_format": "ids",
                 "output_dir": f"{root}/data", "max_length": 64,
                 "generation": {"max_new_tokens": 40, "batch_size": 48}},
        "train": {"num_anchors": 16, "batch_size": 8, "steps": 200, "compute_dtype": "float32", "loss_chunk": 16},
        "optimizer": {"lr": 3e-3},
        "checkpoint": {"dir": f"{root}/ckpt", "every_steps": 50, "keep_last": 3, "async_save": False},
        "eval": {"every_steps": 0, "num_sequences": 16},
        "log": {"every_steps": 25, "progress_bar": False},
        "export": {"dir": f"{root}/export", "dtype": "float32"},
    }
    return _merge(base, sections)


def sigint_at_default() -> None:
    """A `subprocess.Popen(preexec_fn=...)` for a child that a test interrupts with SIGINT: a job started in the
    background ignores SIGINT and its children inherit that (they would run on to their end), so set it back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_when(proc, ready, what: str, timeout: float, poll: float = 0.1, settle: float = 0.0,
                sig: int = signal.SIGKILL, exit_timeout: float = 120.0) -> None:
    """Wait until `ready()` holds, then send `sig` (default SIGKILL) to the subprocess `proc` (stdout
    piped) and wait for it to exit (the caller reads its output after).

    Fails (AssertionError) if the process exits first (with the tail of its output) or `timeout` passes
    ("no <what> in time"). `settle` seconds more are waited before the signal. Never leaves `proc`
    running."""
    try:
        deadline = time.time() + timeout
        while not ready():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, f"no {what} in time"
            time.sleep(poll)
        time.sleep(settle)
        os.kill(proc.pid, sig)
        proc.wait(timeout=exit_timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
