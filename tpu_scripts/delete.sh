#!/usr/bin/env bash
# Delete the TPU VM, or the queued resource and its nodes. Billing stops only once this is done.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

ASYNC=0

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options]

  gcloud compute tpus tpu-vm delete NAME --zone=Z --project=P --quiet
or, with --queued (or --num-slices K > 1),
  gcloud compute tpus queued-resources delete QR --zone=Z --project=P --force --quiet
(--force also deletes the queued resource's TPU nodes). It does not ask: check the name first.

Options:
  --async              return before the deletion has finished

$(common_usage)
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --async) ASYNC=1 ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done
tpu_finalize
where_flags
extra=()
if ((ASYNC)); then extra+=(--async); fi

if is_true "${QUEUED}"; then
  info "deleting queued resource ${QR_NAME} and its nodes in ${ZONE}"
  gc compute tpus queued-resources delete "${QR_NAME}" "${WHERE[@]}" --force --quiet ${extra[@]+"${extra[@]}"} ||
    die "${E_REMOTE}" "deleting queued resource ${QR_NAME} failed; see what is left: gcloud compute tpus queued-resources list --zone=${ZONE}"
else
  info "deleting TPU VM ${NAME} in ${ZONE}"
  gc compute tpus tpu-vm delete "${NAME}" "${WHERE[@]}" --quiet ${extra[@]+"${extra[@]}"} ||
    die "${E_REMOTE}" "deleting TPU VM ${NAME} failed (made with --queued? then pass --queued); see what is left: gcloud compute tpus tpu-vm list --zone=${ZONE}"
fi
is_true "${DRY_RUN}" || info "deleted; check nothing is left: tpu_scripts/status.sh --zone ${ZONE}"
