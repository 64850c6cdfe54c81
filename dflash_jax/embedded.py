"""The embedded reference pair (dflash_jax/assets/reference, built by `python -m train.reference`): a small
Qwen3-architecture target trained on GSM8K chats, its DFlash drafter, and their tokenizer."""
from __future__ import annotations

import os

REFERENCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "reference")


def reference_paths() -> tuple[str | None, str | None]:
    """(target directory, drafter directory) of the embedded pair; None where it is absent."""
    t = os.path.join(REFERENCE_DIR, "target")
    d = os.path.join(REFERENCE_DIR, "drafter")
    if os.path.isfile(os.path.join(t, "config.json")):
        return t, (d if os.path.isfile(os.path.join(d, "config.json")) else None)
    return None, None


def load_reference(dtype: str = "float32", mesh=None):
    """(target, drafter, tokenizer) of the embedded pair. The tokenizer has the pair's chat template, so
    `generate(target, drafter, ["a question"], tokenizer=tokenizer)` sends a question as the pair was trained on
    and returns the decoded `texts`. A checkout without the pair is a FileNotFoundError."""
    t, d = reference_paths()
    if t is None or d is None:
        raise FileNotFoundError(f"the embedded reference pair is not in {REFERENCE_DIR} "
                                f"(build it with `python -m train.reference`)")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    from .text import load_tokenizer
    from .weights import load_drafter, load_target
    target = load_target(t, dtype=dtype, mesh=mesh)
    drafter = load_drafter(d, target, dtype=dtype, mesh=mesh)
    return target, drafter, load_tokenizer(t)
