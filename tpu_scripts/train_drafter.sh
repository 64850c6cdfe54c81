#!/usr/bin/env bash
# Train a DFlash drafter on the TPU VM: `python -m train --config YAML checkpoint.dir=PATH` on every
# worker, with orbax checkpoints in PATH (use gs://... so that a preempted spot VM can resume).
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

CONFIG="${TPU_TRAIN_CONFIG:-}"
CKPT_DIR="${TPU_CKPT_DIR:-}"
BUCKET="${TPU_BUCKET:-}"
RUN_NAME="${TPU_RUN_NAME:-drafter}"
RESUME="${TPU_RESUME:-0}"
OVERRIDES=()

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} --config YAML [--ckpt-dir PATH | --bucket B] [--resume] [options] [-- OVERRIDES...]

On every worker, inside ~/<remote-dir>:
  <python> -m train --config YAML [--resume] [--distributed] checkpoint.dir=PATH [OVERRIDES...]
PATH goes to the train CLI unchanged: a local directory (relative to ~/<remote-dir>) or gs://...
Multi-host slices need a gs:// path (every host writes its own shards), and so does a spot VM
(its disk goes with it when it is preempted). After a preemption: delete, create, setup, then run
this again with --resume: training continues from the last checkpoint in PATH.

Options:
  --config YAML        training config, path inside the repo (required)     TPU_TRAIN_CONFIG
  --ckpt-dir PATH      checkpoint dir, local or gs://...                     TPU_CKPT_DIR
  --bucket B           shorthand for --ckpt-dir gs://B/dflash/RUN_NAME      TPU_BUCKET
  --run-name N         run name for --bucket (default: drafter)              TPU_RUN_NAME
  --resume             pass --resume to the train CLI                        TPU_RESUME=1
  -- OVERRIDES         dotted overrides for the config, e.g. optimizer.lr=3e-4 export.dir=exports/NAME
                       (passed unchanged; the export goes to the config's export.dir unless overridden)

$(job_usage)

$(common_usage)

Example:
  ${SCRIPT_NAME} --type v5p-32 --config configs/qwen3_8b_v5p8.yaml --bucket my-bucket --resume \\
      -- train.epochs=6 export.dir=exports/qwen3-8b
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@" || job_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  FLAG_SHIFT=1
  case "$1" in
    --config | --config=*) flag_value "$@"; CONFIG=${FLAG_VALUE} ;;
    --ckpt-dir | --ckpt-dir=* | --checkpoint-dir | --checkpoint-dir=*) flag_value "$@"; CKPT_DIR=${FLAG_VALUE} ;;
    --bucket | --bucket=*) flag_value "$@"; BUCKET=${FLAG_VALUE} ;;
    --run-name | --run-name=*) flag_value "$@"; RUN_NAME=${FLAG_VALUE} ;;
    --resume) RESUME=1 ;;
    --no-resume) RESUME=0 ;;
    --)
      shift
      OVERRIDES=("$@")
      break
      ;;
    *) usage_error "unknown option '$1' (config overrides go after --)" ;;
  esac
  shift "${FLAG_SHIFT}"
done
[[ -n "${CONFIG}" ]] || usage_error "--config YAML is required (or set TPU_TRAIN_CONFIG)"
[[ -z "${CKPT_DIR}" || -z "${BUCKET}" ]] || usage_error "give --ckpt-dir or --bucket, not both"
[[ "${RUN_NAME}" =~ ^[A-Za-z0-9_.-]+$ ]] || usage_error "--run-name '${RUN_NAME}' may only hold letters, digits, '_', '.', '-'"
if [[ -n "${BUCKET}" ]]; then
  BUCKET=${BUCKET#gs://}
  BUCKET=${BUCKET%/}
  [[ "${BUCKET}" =~ ^[a-z0-9][a-z0-9._-]*[a-z0-9](/[^/]+)*$ ]] || usage_error "--bucket '${BUCKET}' is not a bucket name"
  CKPT_DIR="gs://${BUCKET}/dflash/${RUN_NAME}"
fi
if [[ -z "${CKPT_DIR}" ]]; then
  CKPT_DIR="checkpoints/${RUN_NAME}"
  warn "no --ckpt-dir/--bucket: checkpoints go to the VM's disk (~/${REMOTE_DIR}/${CKPT_DIR}) and are lost with it"
fi
for o in ${OVERRIDES[@]+"${OVERRIDES[@]}"}; do
  [[ "${o}" == *=* || "${o}" == -* ]] || usage_error "override '${o}' is not KEY=VALUE (or a --flag for the train CLI)"
  [[ "${o}" != checkpoint.dir=* ]] || usage_error "set the checkpoint dir with --ckpt-dir, not as an override"
done
if [[ ! -e "${TPU_REPO_ROOT}/${CONFIG}" && "${CONFIG}" != /* ]]; then
  warn "config '${CONFIG}' is not in this checkout (${TPU_REPO_ROOT}); it must exist on the VMs"
fi
tpu_finalize
job_finalize train
if [[ "${CKPT_DIR}" != gs://* ]] && ((HOSTS * NUM_SLICES > 1)); then
  warn "multi-host run with a non-gs:// checkpoint dir '${CKPT_DIR}': each host would hold only its own shards; use --bucket"
fi

argv=("${PYTHON}" -m train --config "${CONFIG}")
if is_true "${RESUME}"; then argv+=(--resume); fi
if ((DISTRIBUTED)); then argv+=(--distributed); fi
argv+=("checkpoint.dir=${CKPT_DIR}" ${OVERRIDES[@]+"${OVERRIDES[@]}"})

info "training with ${CONFIG} on ${NAME} (${TYPE}); checkpoints: ${CKPT_DIR}$(is_true "${RESUME}" && printf ' (resume)')"
run_job "$(shjoin "${argv[@]}")"
