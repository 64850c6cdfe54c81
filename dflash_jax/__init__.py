"""dflash-jax: DFlash block-diffusion speculative decoding and drafter training in JAX."""
from .config import DrafterConfig, TargetConfig, default_target_layer_ids
from .drafter import Drafter, init_drafter
from .decode import (COMPILE_COUNTS, Auto, Chain, GenerationResult, ProgramCache, Shape, TargetOnly, Tree,
                     clear_compile_cache, draft_logits, generate, parse_shape)
from .embedded import load_reference
from .sharding import make_mesh
from .planner import plan, plan_train
from .cache import KVCache
from .model import Target, init_target, relayout, target_logits
from .quant import quantize_drafter, quantize_target
from .weights import load_drafter, load_target, save_drafter, save_target

__all__ = [
    "DrafterConfig", "TargetConfig", "default_target_layer_ids", "Drafter", "init_drafter", "load_drafter",
    "save_drafter", "GenerationResult", "draft_logits", "generate", "COMPILE_COUNTS", "clear_compile_cache",
    "ProgramCache", "Shape", "Auto", "Chain", "Tree", "TargetOnly", "parse_shape", "load_reference", "make_mesh",
    "plan", "plan_train", "KVCache", "Target", "init_target", "load_target", "relayout", "save_target",
    "target_logits", "quantize_target", "quantize_drafter",
]
__version__ = "0.1.0"
