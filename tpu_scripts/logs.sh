#!/usr/bin/env bash
# Stream the log of a background job (started by run.sh, bench_published.sh or train_drafter.sh).
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

WORKER="${TPU_WORKER:-0}"
JOB_LOG="${TPU_LOG:-}"
ONCE=0

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options]

Streams ~/<remote-dir>/logs/LOG.log from one worker (tail -F) until the job writes LOG.log.rc,
then exits with the job's status. Ctrl-C stops the streaming, not the job.

Options:
  --log LOG            job log name: run, bench, train, ... (default: run)   TPU_LOG
  --worker N           worker to read (default 0)                           TPU_WORKER
  --once               print the log so far and the status; do not wait

$(common_usage)
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --log | --log=*) flag_value "$@"; JOB_LOG=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --worker | --worker=*) flag_value "$@"; WORKER=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --once) ONCE=1 ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done
require_uint --worker "${WORKER}"
tpu_finalize
job_finalize run

if ((ONCE)); then
  log="logs/${JOB_LOG}.log"
  # shellcheck disable=SC2016  # $(cat ...) expands on the VM
  peek='cat LOG; if [ -e LOG.rc ]; then echo "[finished with status $(cat LOG.rc)]"; else echo "[still running]"; fi'
  tpu_ssh_first "${WORKER}" "cd $(shq "${REMOTE_DIR}") || exit 1; ${peek//LOG/${log}}" ||
    die "${E_REMOTE}" "could not read ${log} on worker ${WORKER}"
else
  tpu_ssh_first "${WORKER}" "$(follow_command)" ||
    die "${E_REMOTE}" "the job failed, or its log could not be read on worker ${WORKER}"
fi
