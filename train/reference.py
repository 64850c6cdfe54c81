"""python -m train.reference: rebuild the embedded reference pair (dflash_jax/assets/reference) from scratch.

    python -m train.reference [--target-config configs/reference_target.yaml]
        [--drafter-config configs/reference_drafter.yaml] [--stages pretrain,prompts,drafter,ship]
        [--target-override section.key=value ...] [--drafter-override section.key=value ...]

Stages (each skipped when its output exists; training resumes from orbax checkpoints):
  pretrain  tokenizer (byte-level BPE) + from-scratch LM pretraining on GSM8K chats + HF export
  prompts   GSM8K training questions in the paper's math format, for the drafter's data
  drafter   the DFlash pipeline (python -m train): target-generated data, drafter training, export
  ship      copy target + drafter into dflash_jax/assets/reference
"""
import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.reference", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--target-config", default="configs/reference_target.yaml")
    p.add_argument("--drafter-config", default="configs/reference_drafter.yaml")
    p.add_argument("--stages", default="pretrain,prompts,drafter,ship")
    p.add_argument("--target-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--drafter-override", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    from dflash_jax.reference import BUILD_STAGES, build_reference
    stages = tuple(s.strip() for s in a.stages.split(",") if s.strip())
    bad = [s for s in stages if s not in BUILD_STAGES]
    if bad:
        print(f"error: unknown stage(s) {bad}; stages: {list(BUILD_STAGES)}", file=sys.stderr)
        return 2
    try:
        out = build_reference(a.target_config, a.drafter_config, stages, a.target_override, a.drafter_override)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"stage wall times (s): {out['times']}")
    return 0


if __name__ == "__main__":
    from dflash_jax.cli import run
    sys.exit(run(main, resume="run the same command to resume: finished stages are skipped, training "
                              "continues from its checkpoints"))
