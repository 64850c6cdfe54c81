"""The benchmarks behind the `infer/` command lines.

Modules, in import order (each imports only those above it, and dflash_jax's other modules):

    args         the command lines' shared flags and checks (--block-size / --tree-budget, the mesh, generation
                 flags), the shape a call runs and the cache size a benchmark's calls share
    models       the embedded reference pair (reference_paths), the random demo pair, load_models, the random-weight
                 targets of the micro benchmarks (BENCH_CONFIGS, bench_target_config)
    bandwidth    target-only decode against memory bandwidth (infer.bench_decode); best_time, time_decode
    datasets     one prompt in both modes (compare_prompt, infer.generate); a prompt set side by side with
                 target-only (run_benchmark, infer.benchmark), the automatic shape beside fixed ones, the report files
    cycle_parts  a cycle's cost in target steps (infer.bench_cycle): the fused loop per shape, and the real
                 cycle's stages (decode.programs draft_stage / verify_stage / accept_stage, the tree's) jitted apart

The serving benchmark (infer.bench_serve) is imported on its own, not from here (it needs httpx, the `serve` extra):

    serve_client the server in a subprocess (ServerProcess: /health, /metrics, its RSS), one request of each kind
                 (send, send_all: closed-loop asyncio clients), the prompt set's questions
    serve_bench  the load test (run_load) and the throughput comparison, speculation on against off
                 (run_throughput), their printed tables and JSON
"""
from .args import (add_mesh_args, add_shape_args, cache_len_for, check_generation_args, int_or_auto, log,
                   looks_like_hub_id, main_error, mesh_from_args, shape_args, shape_label, show_library_log,
                   verify_width)
from .bandwidth import best_time, bench_decode, copy_bandwidth, memory_bandwidth, print_decode_table, time_decode
from .cycle_parts import (TOPK_CHUNK, bench_cycle, chain_parts, keep_position, prefilled, print_cycle_table,
                          time_chain_parts, time_tree_parts, tree_parts)
from .datasets import (WARMUP_LOOKS, ModeStats, auto_against_fixed, compare_prompt, describe_differences,
                       first_difference, format_histogram, generate_mode, plot_histogram, run_benchmark, write_report)
from .models import (BENCH_CONFIGS, QWEN3_0P6B, REFERENCE_DIR, TINY, bench_target_config, build_demo_models,
                     demo_banner, drafter_taps, load_models, random_prompts, reference_paths, tree_bytes)

__all__ = [
    "BENCH_CONFIGS", "ModeStats", "QWEN3_0P6B", "REFERENCE_DIR", "TINY", "TOPK_CHUNK", "WARMUP_LOOKS",
    "add_mesh_args", "add_shape_args", "auto_against_fixed", "bench_cycle", "bench_decode", "bench_target_config",
    "best_time", "build_demo_models", "cache_len_for", "chain_parts", "check_generation_args", "compare_prompt",
    "copy_bandwidth", "demo_banner", "describe_differences", "drafter_taps", "first_difference", "format_histogram",
    "generate_mode", "int_or_auto", "keep_position", "load_models", "log", "looks_like_hub_id", "main_error",
    "memory_bandwidth", "mesh_from_args", "plot_histogram", "prefilled", "print_cycle_table", "print_decode_table",
    "random_prompts", "reference_paths", "run_benchmark", "shape_args", "shape_label", "show_library_log",
    "tree_bytes", "time_chain_parts", "time_decode", "time_tree_parts", "tree_parts", "verify_width", "write_report",
]
