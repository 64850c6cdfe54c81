#!/usr/bin/env bash
# Copy results from worker 0 of the TPU VM (or from a gs:// path) to this machine.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

FROM="${TPU_FETCH_FROM:-results}"
TO="${TPU_FETCH_TO:-}"
WORKER="${TPU_WORKER:-0}"

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options]

  gcloud compute tpus tpu-vm scp --recurse NAME:<remote-dir>/FROM TO --zone=Z --project=P --worker=0
or, when FROM is gs://BUCKET/PATH,
  gcloud storage cp --recursive gs://BUCKET/PATH TO

Options:
  --from PATH          remote path, relative to ~/<remote-dir> unless it is absolute or ~/...;
                       or gs://... (default: results)                        TPU_FETCH_FROM
  --to DIR             local directory (default: tpu-results/NAME)           TPU_FETCH_TO
  --worker N           worker to copy from (default 0: multi-host jobs write their results there)

$(common_usage)
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --from | --from=*) flag_value "$@"; FROM=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --to | --to=*) flag_value "$@"; TO=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --worker | --worker=*) flag_value "$@"; WORKER=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done
require_uint --worker "${WORKER}"
tpu_finalize
TO=${TO:-tpu-results/${NAME}}

if is_true "${DRY_RUN}"; then
  printf '# locally: mkdir -p %s\n' "$(shq "${TO}")"
else
  mkdir -p "${TO}"
fi
if [[ "${FROM}" == gs://* ]]; then
  gc storage cp --recursive "${FROM}" "${TO}" || die "${E_REMOTE}" "copying ${FROM} failed"
else
  tpu_scp_from "${WORKER}" "$(remote_path "${FROM}")" "${TO}" ||
    die "${E_REMOTE}" "copying ${FROM} from worker ${WORKER} failed"
fi
is_true "${DRY_RUN}" || info "fetched into ${TO}"
