#!/usr/bin/env bash
# Run a command on every worker of the TPU VM, inside the project directory.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

WORKER="${TPU_WORKER:-all}"
CMD=()

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options] -- COMMAND [ARGS...]
       ${SCRIPT_NAME} [options] -- 'SHELL SNIPPET'

Runs COMMAND in ~/<remote-dir> on every worker (all hosts of a multi-host slice, every slice of a
multislice) with
  gcloud compute tpus tpu-vm ssh NAME --zone=Z --project=P --worker=all --command=...
Several words after -- are quoted one by one; a single word is taken as a shell snippet.
By default the command runs in the background (nohup) and worker 0's log is streamed until it ends
(see the job options); --foreground runs it over a plain ssh session instead.

Options:
  --worker W           all (default), or 0, 1-3, 0,2 ... (with --foreground)   TPU_WORKER

$(job_usage)

$(common_usage)

Examples:
  ${SCRIPT_NAME} --foreground -- ~/dflash-venv/bin/python -c 'import jax; print(jax.devices())'
  ${SCRIPT_NAME} --log smoke -- ~/dflash-venv/bin/python -m infer.benchmark --help
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@" || job_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --worker | --worker=*) flag_value "$@"; WORKER=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --)
      shift
      CMD=("$@")
      break
      ;;
    *) usage_error "unknown option '$1' (put the command after --)" ;;
  esac
done
((${#CMD[@]} > 0)) || usage_error "no command given after --"
[[ "${WORKER}" =~ ^(all|[0-9]+([-,][0-9]+)*)$ ]] || usage_error "--worker '${WORKER}' must be all, N, N-M or N,M,..."
tpu_finalize
job_finalize run
if [[ "${WORKER}" != all && "${JOB_MODE}" != foreground ]]; then
  usage_error "--worker ${WORKER} needs --foreground (background jobs start on every worker)"
fi

if ((${#CMD[@]} == 1)); then body=${CMD[0]}; else body=$(shjoin "${CMD[@]}"); fi
if [[ "${WORKER}" != all ]]; then
  tpu_ssh "${WORKER}" "cd $(shq "${REMOTE_DIR}") || exit 1; $(job_env_prefix)${body}" ||
    die "${E_REMOTE}" "the command failed on worker ${WORKER}"
else
  run_job "${body}"
fi
