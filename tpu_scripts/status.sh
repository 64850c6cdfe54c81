#!/usr/bin/env bash
# Show the state of the TPU VM (or queued resource) and list the TPUs in the zone.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options]

  gcloud compute tpus tpu-vm describe NAME --zone=Z --project=P     (or queued-resources describe QR)
  gcloud compute tpus queued-resources list --zone=Z --project=P    (with --queued)
  gcloud compute tpus tpu-vm list --zone=Z --project=P

$(common_usage)
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  usage_error "unknown option '$1'"
done
tpu_finalize
where_flags
rc=0
if is_true "${QUEUED}"; then
  gc compute tpus queued-resources describe "${QR_NAME}" "${WHERE[@]}" || rc=${E_REMOTE}
  gc compute tpus queued-resources list "${WHERE[@]}" || rc=${E_REMOTE}
else
  gc compute tpus tpu-vm describe "${NAME}" "${WHERE[@]}" || rc=${E_REMOTE}
fi
gc compute tpus tpu-vm list "${WHERE[@]}" || rc=${E_REMOTE}
exit "${rc}"
