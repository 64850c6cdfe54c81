"""The command lines' shared arguments and checks, and the shape and cache size a benchmark's calls share.

- `add_shape_args` / `add_mesh_args`: --block-size / --tree-budget, and the device mesh flags;
  `check_generation_args`: the generation flags' errors, one line each, before any model loads.
- `mesh_from_args`, `show_library_log`: the mesh (or None on one device) and the library's log on stdout.
- `shape_args`, `shape_label`, `verify_width`, `cache_len_for`: a shape as generate() reads it, its report
  label, the cache slots one verification writes, one cache size for both modes of a batch.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from ..cli import main_error


def log(msg: str = "") -> None:
    print(msg, flush=True)


def int_or_auto(v: str):
    """argparse type of --block-size / --tree-budget: an integer or 'auto' (the shape they make together is
    checked by check_generation_args, with decode.shape.parse_shape)."""
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {v!r}") from None


def add_shape_args(p, tree_auto: bool = True) -> None:
    """--block-size (default auto) and --tree-budget (default the chain; 'auto' too if tree_auto)."""
    p.add_argument("--block-size", type=int_or_auto, default="auto",
                   help="drafter block size N: a chain of N (or the tree's depth with --tree-budget); default "
                        "'auto': target-only, chain or tree, chosen per call from the measured cost curve and the "
                        "acceptance so far")
    p.add_argument("--tree-budget", type=int_or_auto if tree_auto else int, default=None,
                   help="verify a draft tree of this many nodes per cycle (DDTree-style; depth <= block size - 1, "
                        "the drafter's block unless --block-size N) instead of the chain of drafts"
                        + ("; 'auto': as --block-size auto" if tree_auto else ""))


def add_mesh_args(p) -> None:
    """--model-parallel / --data-parallel and the multi-host flags (dflash_jax.distributed)."""
    from ..distributed import add_distributed_args
    g = p.add_argument_group("devices")
    g.add_argument("--model-parallel", type=int, default=1, help="tensor-parallel degree (mesh 'model' axis)")
    g.add_argument("--data-parallel", type=int, default=None,
                   help="batch-parallel degree (mesh 'data' axis; default: the remaining devices)")
    add_distributed_args(p)


def add_quant_args(p) -> None:
    """--quant / --kv-quant / --drafter-quant: the target's weights / KV cache, the drafter's weights in int8 or fp8
    (dflash_jax.quant)."""
    g = p.add_argument_group("quantized target")
    g.add_argument("--quant", choices=("int8", "fp8"), help="target weights: 1 byte + a scale per output channel")
    g.add_argument("--kv-quant", choices=("int8", "fp8"), help="target KV cache: 1 byte + a scale per token and head")
    g.add_argument("--drafter-quant", choices=("int8", "fp8"), help="drafter weights in 1 byte (drafts only: lossless)")


def check_generation_args(args) -> None:
    """Errors in the CLIs' shared generation flags that need no model, reported before anything loads."""
    import math
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        main_error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        main_error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        main_error(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_new_tokens < 1:
        main_error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if getattr(args, "repeats", 1) < 1:
        main_error(f"--repeats must be >= 1, got {args.repeats}")
    if getattr(args, "batch_size", 1) < 1:
        main_error(f"--batch-size must be >= 1, got {args.batch_size}")
    from ..decode.shape import parse_shape
    try:
        parse_shape(args.block_size, getattr(args, "tree_budget", None))
    except ValueError as e:
        main_error(f"--block-size / --tree-budget: {e}")
    for flag in ("target", "drafter", "tokenizer"):
        path = getattr(args, flag, None)
        if path and os.path.isfile(path):
            main_error(f"--{flag} {path} is a file; expected a model directory")
        if path and not os.path.exists(path) and not looks_like_hub_id(path):
            main_error(f"--{flag} directory {path} does not exist")


def looks_like_hub_id(path: str) -> bool:
    """'owner/name', which load_target / load_drafter fetch from the hub when online."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def show_library_log() -> None:
    """The library's INFO log (auto's choices, its cost measurement) on stdout, one plain line a record: the CLIs
    show it, the library itself never prints. Call after mesh_from_args (other processes: stdout is null)."""
    import logging
    lib = logging.getLogger("dflash_jax")
    if not any(getattr(h, "dflash_cli", False) for h in lib.handlers):
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter("%(message)s"))
        h.dflash_cli = True
        lib.addHandler(h)
    lib.setLevel(logging.INFO)


def mesh_from_args(args):
    """Initialise jax.distributed when asked; a ('data', 'model') mesh when there is more than one
    device (None on a single device). Non-zero processes print nothing."""
    import jax
    from ..distributed import is_main_process, maybe_initialize
    from ..sharding import make_mesh
    maybe_initialize(args)
    if not is_main_process():
        sys.stdout = open(os.devnull, "w")
    if jax.device_count() == 1 and args.model_parallel == 1 and args.data_parallel in (None, 1):
        return None
    return make_mesh(args.data_parallel, args.model_parallel)


# ----------------------------------------------------------------------------------------------
# Shapes and cache sizes of a benchmark's calls
# ----------------------------------------------------------------------------------------------
def shape_args(drafter, block_size, tree_budget):
    """(block_size, tree_budget, Bk) as generate() reads them: "auto" in either is the automatic shape
    (both then "auto"); block "auto" with a tree of N nodes is the drafter's own block (None). Bk: the
    block the histogram counts up to (the drafter's under auto; 1 without a drafter)."""
    from ..decode.shape import Auto, parse_shape
    if drafter is None:
        return None, None, 1
    shape = parse_shape(block_size, tree_budget)
    if isinstance(shape, Auto):
        return "auto", "auto", drafter.config.block_size
    return shape.block, shape.tree, shape.resolve(drafter.config.block_size).block


def shape_label(block: int | None, tree: int | None = None) -> str:
    """How reports name the shape a call ran: "target-only", "B=8", "tree 16"."""
    from ..decode.shape import Chain, TargetOnly, Tree
    if tree:
        return Tree(tree).label
    return TargetOnly().label if not block or block == 1 else Chain(block).label


def verify_width(block, tree_budget) -> int:
    """Cache slots one verification writes: the block, or the tree's root + nodes; with "auto", the
    widest shape auto may choose."""
    from ..decode.state import verify_width as width
    if block == "auto" or tree_budget == "auto":
        from ..auto import TREE_BUDGETS
        return max(TREE_BUDGETS) + 1
    return width(block, tree_budget)


def cache_len_for(prompt_lens: Sequence[int], max_new_tokens: int, block: int, max_positions: int | None = None) -> int:
    """One cache size for both modes of a batch (same attention cost): prompt bucket + new + block,
    with the new tokens capped by the model's context (`max_positions`) as `generate` caps them."""
    from ..decode.state import CACHE_ALIGN, bucket, capped_new_tokens, round_up
    longest = max(prompt_lens)
    if max_positions is not None:
        max_new_tokens = capped_new_tokens(max_positions, longest, max_new_tokens)
    return round_up(max(bucket(longest), longest + max_new_tokens + block), CACHE_ALIGN)
