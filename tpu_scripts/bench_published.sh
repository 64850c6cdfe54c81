#!/usr/bin/env bash
# Benchmark the published pair Qwen/Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 on the five data sets
# (gsm8k, math500, humaneval, mbpp, mt-bench) on every worker of the TPU VM.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

TARGET="${TPU_BENCH_TARGET:-Qwen/Qwen3-8B}"
DRAFTER="${TPU_BENCH_DRAFTER:-z-lab/Qwen3-8B-DFlash-b16}"
DATASETS="${TPU_BENCH_DATASETS:-gsm8k,math500,humaneval,mbpp,mt-bench}"
MAX_SAMPLES="${TPU_BENCH_MAX_SAMPLES:-100}"
OUT="${TPU_BENCH_OUT:-results/published}"
DTYPE="${TPU_BENCH_DTYPE:-bfloat16}"
FETCH_TO=""
EXTRA=()

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options] [-- EXTRA BENCHMARK ARGS...]

For each data set D, on every worker, inside ~/<remote-dir>:
  <python> -m infer.benchmark --target ${TARGET} --drafter ${DRAFTER} \\
      --dataset D --max-samples N --out OUT/D --dtype ${DTYPE} [--distributed] [EXTRA...]
(--distributed, and DFLASH_DISTRIBUTED=1, are added on multi-host slices so that the CLI calls
jax.distributed.initialize(); results are written by process 0, i.e. worker 0.)
Data sets are read by name: from ../shared/data when setup.sh --data copied it there, else the hub.

Options:
  --target ID          target model (default: Qwen/Qwen3-8B)                TPU_BENCH_TARGET
  --drafter ID         drafter (default: z-lab/Qwen3-8B-DFlash-b16)         TPU_BENCH_DRAFTER
  --datasets A,B,...   data sets (default: gsm8k,math500,humaneval,mbpp,mt-bench)  TPU_BENCH_DATASETS
  --max-samples N      prompts per data set (default: 100)                  TPU_BENCH_MAX_SAMPLES
  --out DIR            output dir on the VM, relative to ~/<remote-dir> (default: results/published)
                                                                            TPU_BENCH_OUT
  --dtype D            weights/compute dtype for the benchmark (default: bfloat16)  TPU_BENCH_DTYPE
  --fetch DIR          when the job has finished, copy OUT from worker 0 to local DIR

$(job_usage)

$(common_usage)

Example:
  ${SCRIPT_NAME} --max-samples 20 --fetch tpu-results/published -- --max-new-tokens 2048
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@" || job_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --target | --target=*) flag_value "$@"; TARGET=${FLAG_VALUE} ;;
    --drafter | --drafter=*) flag_value "$@"; DRAFTER=${FLAG_VALUE} ;;
    --datasets | --datasets=* | --dataset | --dataset=*) flag_value "$@"; DATASETS=${FLAG_VALUE} ;;
    --max-samples | --max-samples=*) flag_value "$@"; MAX_SAMPLES=${FLAG_VALUE} ;;
    --out | --out=*) flag_value "$@"; OUT=${FLAG_VALUE} ;;
    --dtype | --dtype=*) flag_value "$@"; DTYPE=${FLAG_VALUE} ;;
    --fetch | --fetch=*) flag_value "$@"; FETCH_TO=${FLAG_VALUE} ;;
    --)
      shift
      EXTRA=("$@")
      break
      ;;
    *) usage_error "unknown option '$1' (benchmark arguments go after --)" ;;
  esac
  shift "${FLAG_SHIFT}"
done
require_uint --max-samples "${MAX_SAMPLES}" 1
[[ "${DTYPE}" == bfloat16 || "${DTYPE}" == float32 ]] || usage_error "--dtype must be bfloat16 or float32, got '${DTYPE}'"
IFS=',' read -r -a SETS <<<"${DATASETS}"
((${#SETS[@]} > 0)) || usage_error "--datasets is empty"
for d in "${SETS[@]}"; do
  [[ "${d}" =~ ^[A-Za-z0-9_.-][A-Za-z0-9_./-]*$ ]] || usage_error "bad data set name '${d}' in --datasets '${DATASETS}'"
done
tpu_finalize
job_finalize bench
if [[ -n "${FETCH_TO}" && "${JOB_MODE}" == detach ]]; then
  usage_error "--fetch needs the job to be followed: drop --detach, or run fetch.sh --from ${OUT} later"
fi

body="rc=0"
for d in "${SETS[@]}"; do
  argv=("${PYTHON}" -m infer.benchmark --target "${TARGET}" --drafter "${DRAFTER}" --dataset "${d}"
    --max-samples "${MAX_SAMPLES}" --out "${OUT%/}/${d//\//_}" --dtype "${DTYPE}")
  if ((DISTRIBUTED)); then argv+=(--distributed); fi
  argv+=(${EXTRA[@]+"${EXTRA[@]}"})
  body+="; $(shjoin echo === "${d}" ===); $(shjoin "${argv[@]}") || rc=1"
done
# shellcheck disable=SC2016  # $rc expands on the VM
body+='; exit "$rc"'

info "benchmarking ${TARGET} + ${DRAFTER} on ${SETS[*]} (${MAX_SAMPLES} samples each) on ${NAME}"
run_job "${body}"
if [[ -n "${FETCH_TO}" ]]; then
  if is_true "${DRY_RUN}"; then
    printf '# locally: mkdir -p %s\n' "$(shq "${FETCH_TO}")"
  else
    mkdir -p "${FETCH_TO}"
  fi
  tpu_scp_from 0 "$(remote_path "${OUT}")" "${FETCH_TO}" || die "${E_REMOTE}" "fetching ${OUT} failed"
fi
