#!/usr/bin/env bash
# Create a Cloud TPU VM (default: v5p-8 in us-east5-a) or a queued resource for one.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

SPOT="${TPU_SPOT:-0}"
WAIT="${TPU_WAIT:-1}"
WAIT_TIMEOUT="${TPU_WAIT_TIMEOUT:-7200}"
EXTRA=()

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options]

Create a TPU VM:
  gcloud compute tpus tpu-vm create NAME --zone=Z --project=P --accelerator-type=T --version=R [--spot]
or, with --queued (or --num-slices K > 1), a queued resource, which waits in line for capacity:
  gcloud compute tpus queued-resources create QR --zone=Z --project=P --accelerator-type=T
      --runtime-version=R (--node-id=NAME | --node-count=K --node-prefix=NAME) [--spot]
A multi-host slice (v5p-16, v5p-32, v6e-16, ...) is one node whose hosts are its workers; the
accelerator type alone sets its size. --num-slices K > 1 asks for K such slices (multislice).

Options:
  --spot               spot capacity (much cheaper, can be preempted at any time)  TPU_SPOT=1
  --no-wait            queued resource: return once requested, do not wait for ACTIVE  TPU_WAIT=0
  --wait-timeout S     queued resource: give up waiting after S seconds (default 7200)  TPU_WAIT_TIMEOUT
  --gcloud-flag F      extra flag for the create command, repeatable
                       (e.g. --gcloud-flag=--reserved, --gcloud-flag=--service-account=SA,
                        --gcloud-flag=--valid-until-duration=6h for queued resources)

$(common_usage)

Examples:
  ${SCRIPT_NAME} --project my-proj                         # v5p-8, on demand
  ${SCRIPT_NAME} --type v5p-32 --queued --spot             # 4-host slice, spot, queued
  ${SCRIPT_NAME} --type v6e-8 --dry-run                    # print the command only
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --spot) SPOT=1 ;;
    --no-spot) SPOT=0 ;;
    --wait) WAIT=1 ;;
    --no-wait) WAIT=0 ;;
    --wait-timeout | --wait-timeout=*) flag_value "$@"; WAIT_TIMEOUT=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --gcloud-flag | --gcloud-flag=*) flag_value "$@"; EXTRA+=("${FLAG_VALUE}"); shift "${FLAG_SHIFT}"; continue ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done
require_uint --wait-timeout "${WAIT_TIMEOUT}"
require_uint TPU_POLL_SECONDS "${POLL_SECONDS}"
tpu_finalize
where_flags

if ! is_true "${QUEUED}"; then
  cmd=(compute tpus tpu-vm create "${NAME}" "${WHERE[@]}" "--accelerator-type=${TYPE}" "--version=${RUNTIME}")
  if is_true "${SPOT}"; then cmd+=(--spot); fi
  cmd+=(${EXTRA[@]+"${EXTRA[@]}"})
  info "creating TPU VM ${NAME} (${TYPE}, ${ZONE}, runtime ${RUNTIME}$(is_true "${SPOT}" && printf ', spot'))"
  gc "${cmd[@]}" || die "${E_REMOTE}" "creating TPU VM ${NAME} failed (quota? capacity? try --queued, another zone, or --spot)"
  is_true "${DRY_RUN}" || info "ready: next run tpu_scripts/setup.sh --name ${NAME} --zone ${ZONE}"
  exit 0
fi

cmd=(compute tpus queued-resources create "${QR_NAME}" "${WHERE[@]}" "--accelerator-type=${TYPE}" "--runtime-version=${RUNTIME}")
if ((NUM_SLICES > 1)); then
  cmd+=("--node-count=${NUM_SLICES}" "--node-prefix=${NAME}")
else
  cmd+=("--node-id=${NAME}")
fi
if is_true "${SPOT}"; then cmd+=(--spot); fi
cmd+=(${EXTRA[@]+"${EXTRA[@]}"})
info "requesting queued resource ${QR_NAME} (${NUM_SLICES} x ${TYPE}, ${ZONE}, runtime ${RUNTIME}$(is_true "${SPOT}" && printf ', spot'))"
gc "${cmd[@]}" || die "${E_REMOTE}" "creating queued resource ${QR_NAME} failed"

is_true "${WAIT}" || exit 0
describe=(compute tpus queued-resources describe "${QR_NAME}" "${WHERE[@]}" "--format=value(state.state)")
if is_true "${DRY_RUN}"; then
  printf '# then poll every %ss until the state is ACTIVE:\n' "${POLL_SECONDS}"
  gc "${describe[@]}"
  exit 0
fi
start=${SECONDS}
last=""
while :; do
  state=$(gcloud "${describe[@]}" 2>/dev/null) || state="UNKNOWN"
  state=${state//[[:space:]]/}
  [[ "${state}" == "${last}" ]] || info "queued resource ${QR_NAME}: ${state}"
  last=${state}
  case "${state}" in
    ACTIVE) break ;;
    FAILED | SUSPENDED | SUSPENDING)
      die "${E_TIMEOUT}" "queued resource ${QR_NAME} is ${state}; see: gcloud compute tpus queued-resources describe ${QR_NAME} --zone=${ZONE}; delete it with tpu_scripts/delete.sh --queued --name ${NAME}"
      ;;
  esac
  if ((SECONDS - start >= 10#${WAIT_TIMEOUT})); then
    die "${E_TIMEOUT}" "queued resource ${QR_NAME} still ${state} after ${WAIT_TIMEOUT}s; it stays queued: check later with tpu_scripts/status.sh --queued, or delete it with tpu_scripts/delete.sh --queued"
  fi
  sleep "${POLL_SECONDS}"
done
info "ready: next run tpu_scripts/setup.sh --name ${NAME} --zone ${ZONE}$( ((NUM_SLICES > 1)) && printf ' --num-slices %s' "${NUM_SLICES}")"
