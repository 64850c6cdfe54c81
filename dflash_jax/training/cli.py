"""Command-line front ends shared by `python -m train`, `train.generate_data` and `train.export`."""
from __future__ import annotations

import argparse
import sys

from .config import load_config
from .interrupt import Interrupted


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-4 train.steps=100")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    from ..distributed import add_distributed_args
    add_distributed_args(p)
    return p


def _parse(p: argparse.ArgumentParser, argv):
    a = p.parse_args(argv)
    from ..distributed import maybe_initialize
    maybe_initialize(a)  # before any JAX computation: multi-host jobs see all hosts' devices
    return a


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _interrupted(cfg, e: BaseException) -> int:
    """One line on Ctrl-C (no traceback): where the job stopped and how to continue. 130 = SIGINT."""
    if isinstance(e, Exception):  # Interrupted: the training loop saved its step and says so
        msg = str(e)
    else:
        msg = "interrupted; " + _where(cfg) + "; run the same command to resume"
    print(msg, file=sys.stderr)
    return 130


def _where(cfg) -> str:
    """What an interrupted run has kept: the data generation progress and the latest checkpoint."""
    if cfg is None:
        return "nothing was written"
    import os
    from .data import interrupted_progress
    parts = []
    try:
        prog = interrupted_progress(cfg.data.output_dir)
    except Exception:  # noqa: BLE001 - an unreadable output_dir is reported as having no progress
        prog = None
    if prog is not None:
        parts.append(f"data generation: {prog[0]}/{prog[1]} prompts done in {cfg.data.output_dir}")
    try:
        from .checkpoint import Checkpointer
        d = cfg.checkpoint.dir
        latest = Checkpointer(d, read_only=True).latest_step() if "://" in d or os.path.isdir(d) else None
    except Exception:  # noqa: BLE001 - an unreadable directory is reported as having no checkpoint
        latest = None
    parts.append(f"last checkpoint: step {latest} in {cfg.checkpoint.dir}" if latest is not None
                 else "no training checkpoint yet")
    return "; ".join(parts)


def main_all(argv=None) -> int:
    p = _parser("python -m train", "Generate data with the target (if not complete), train the drafter, export it.")
    p.add_argument("--stages", default="generate,train,export",
                   help="comma list of stages to run (generate, train, export)")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in checkpoint.dir (the default; accepted for scripts)")
    res.add_argument("--no-resume", action="store_true",
                     help="refuse to continue when checkpoint.dir already has checkpoints (default: resume)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even though trajectory settings changed since the checkpoint")
    a = _parse(p, argv)
    cfg = None
    try:
        cfg = load_config(a.config, a.overrides)
        from .pipeline import run
        stages = tuple(s.strip() for s in a.stages.split(",") if s.strip())
        out = run(cfg, stages, resume=not a.no_resume, allow_config_change=a.allow_config_change,
                  progress=False if a.no_progress else None)
    except (ValueError, FileNotFoundError) as e:  # ConfigError, DataError, model mismatches
        return _fail(e)
    except (Interrupted, KeyboardInterrupt) as e:
        return _interrupted(cfg, e)
    tr = out.get("train")
    if tr:
        for key, what in (("tau", "held-out blocks, expected acceptance length"),
                          ("gen_tau", "held-out prompts, speculative decoding tau")):
            before = tr.get("eval_before", {}).get(key)
            after = tr.get("eval_after", {}).get(key)
            if after is not None:
                b = "" if before is None else f"{before:.3f} -> "
                print(f"{what}: {b}{after:.3f} (step {tr.get('final_step')})")
    if out.get("export"):
        print(f"drafter: {out['export']}")
    return 0


def main_generate(argv=None) -> int:
    p = _parser("python -m train.generate_data", "Generate self-distillation data with the target (restartable).")
    a = _parse(p, argv)
    cfg = None
    try:
        cfg = load_config(a.config, a.overrides)
        from .pipeline import ensure_target
        from .data import generate_data
        from .records import check_prompt_source
        check_prompt_source(cfg.data)  # before ensure_target writes anything
        ensure_target(cfg)
        prog = generate_data(cfg, progress=not a.no_progress and cfg.log.progress_bar)
    except (ValueError, FileNotFoundError) as e:  # ConfigError, DataError, model mismatches
        return _fail(e)
    except (Interrupted, KeyboardInterrupt) as e:
        return _interrupted(cfg, e)
    print(f"{prog['done']}/{prog['total']} prompts done, {prog['sequences']} sequences, {prog['tokens']} tokens "
          f"in {cfg.data.output_dir}")
    return 0


def main_export(argv=None) -> int:
    p = _parser("python -m train.export", "Export a training checkpoint as a z-lab DFlash drafter directory.")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", default=None, help="output directory (default: export.dir or <checkpoint.dir>/export)")
    a = _parse(p, argv)
    cfg = None
    try:
        cfg = load_config(a.config, a.overrides)
        from .pipeline import export
        export(cfg, step=a.step, out=a.out)
    except (ValueError, FileNotFoundError) as e:  # ConfigError, DataError, model mismatches
        return _fail(e)
    except KeyboardInterrupt as e:
        return _interrupted(cfg, e)
    return 0
