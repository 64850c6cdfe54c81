#!/usr/bin/env bash
# shellcheck disable=SC2034  # variables set here are read by the scripts that source this file
# shellcheck disable=SC2088  # "~/..." strings are paths for the VM's shell, not this one
# Shared flag/env parsing and gcloud helpers for the scripts in tpu_scripts/.
# This file is sourced by the other scripts; it does nothing when run on its own.
#
# Conventions:
#   * every value comes from a flag, else from an environment variable, else from a default
#     (flags win over env, env wins over defaults);
#   * every gcloud call goes through `gc`, which prints `+ gcloud ...` (one line, shell-quoted, so
#     the line can be pasted into a terminal) and, unless --dry-run, runs it;
#   * in --dry-run mode nothing is run and neither gcloud nor an authenticated account is needed.
set -euo pipefail

if [[ "${BASH_SOURCE[0]}" == "${0}" ]]; then
  printf 'common.sh is a library: source it from the other tpu_scripts/*.sh scripts.\n' >&2
  exit 2
fi

# ----------------------------------------------------------------------------- locations
if [[ "${BASH_SOURCE[0]}" == */* ]]; then
  TPU_SCRIPTS_DIR="$(cd "${BASH_SOURCE[0]%/*}" && pwd)"
else
  TPU_SCRIPTS_DIR="$(pwd)"
fi
TPU_REPO_ROOT="$(cd "${TPU_SCRIPTS_DIR}/.." && pwd)"
SCRIPT_NAME="${0##*/}"

# ----------------------------------------------------------------------------- exit codes
readonly E_USAGE=2       # bad flag, bad value, missing required flag
readonly E_NO_GCLOUD=3   # gcloud not on PATH
readonly E_NO_AUTH=4     # gcloud has no active account
readonly E_NO_PROJECT=5  # no project from --project, TPU_PROJECT or `gcloud config`
readonly E_REMOTE=6      # a gcloud command or a remote job failed
readonly E_TIMEOUT=7     # waiting for a queued resource timed out or it failed

# ----------------------------------------------------------------------------- messages
info() { printf '[%s] %s\n' "${SCRIPT_NAME}" "$*" >&2; }
warn() { printf '[%s] warning: %s\n' "${SCRIPT_NAME}" "$*" >&2; }
# die CODE MESSAGE...
die() {
  local code=$1
  shift
  printf '%s: error: %s\n' "${SCRIPT_NAME}" "$*" >&2
  exit "${code}"
}
usage_error() { die "${E_USAGE}" "$* (see ${SCRIPT_NAME} --help)"; }

is_true() {
  case "${1:-}" in
    1 | true | TRUE | True | yes | YES | on | ON) return 0 ;;
    *) return 1 ;;
  esac
}

# ----------------------------------------------------------------------------- quoting
# shq WORD: WORD quoted for a POSIX shell; left bare when it only has harmless characters.
# A leading "~/" stays unquoted so that the remote shell expands it to the remote home.
shq() {
  local s=$1 prefix=""
  if [[ "${s}" == "~/"* ]]; then
    prefix="~/"
    s=${s:2}
    [[ -n "${s}" ]] || {
      printf '%s' "${prefix}"
      return
    }
  fi
  if [[ -z "${prefix}" && "${s}" =~ ^(--[A-Za-z0-9-]+=)(.*[^A-Za-z0-9_./:=@%+,-].*)$ ]]; then
    # --flag=value with an awkward value: quote the value only (same word for the shell)
    prefix=${BASH_REMATCH[1]}
    s=${BASH_REMATCH[2]}
  fi
  if [[ -n "${s}" && "${s}" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s%s' "${prefix}" "${s}"
  else
    printf "%s'%s'" "${prefix}" "${s//\'/\'\\\'\'}"
  fi
}

# shjoin WORD...: the words quoted and joined by spaces (a command line).
shjoin() {
  local out="" w
  for w in "$@"; do
    out+="${out:+ }$(shq "${w}")"
  done
  printf '%s' "${out}"
}

# ----------------------------------------------------------------------------- flag values
# flag_value "$@": value of the option at $1, either "--flag=value" or "--flag value".
# Sets FLAG_VALUE and FLAG_SHIFT (how many words to shift).
FLAG_VALUE=""
FLAG_SHIFT=1
flag_value() {
  local flag=$1
  if [[ "${flag}" == --*=* ]]; then
    FLAG_VALUE=${flag#*=}
    FLAG_SHIFT=1
  else
    [[ $# -ge 2 ]] || usage_error "option ${flag} needs a value"
    FLAG_VALUE=$2
    FLAG_SHIFT=2
  fi
  [[ -n "${FLAG_VALUE}" ]] || usage_error "option ${flag%%=*} needs a non-empty value"
}

require_uint() { # require_uint FLAG VALUE [MIN]
  [[ "$2" =~ ^[0-9]+$ ]] || usage_error "$1 must be a whole number, got '$2'"
  if [[ -n "${3:-}" ]] && ((10#$2 < $3)); then
    usage_error "$1 must be at least $3, got '$2'"
  fi
}

# ----------------------------------------------------------------------------- settings
DEFAULT_VENV='~/dflash-venv'
PROJECT="${TPU_PROJECT:-}"
ZONE="${TPU_ZONE:-}"
TYPE="${TPU_TYPE:-v5p-8}"
RUNTIME="${TPU_RUNTIME:-}"
NAME="${TPU_NAME:-dflash-tpu}"
QR_NAME="${TPU_QR_NAME:-}"
QUEUED="${TPU_QUEUED:-0}"
NUM_SLICES="${TPU_NUM_SLICES:-1}"
HOSTS_OVERRIDE="${TPU_HOSTS:-}"
DRY_RUN="${TPU_DRY_RUN:-0}"
REMOTE_DIR="${TPU_REMOTE_DIR:-dflash-jax}"
VENV="${TPU_VENV:-${DEFAULT_VENV}}"
PYTHON="${TPU_PYTHON:-}"
POLL_SECONDS="${TPU_POLL_SECONDS:-30}"
FOLLOW_POLL_SECONDS="${TPU_FOLLOW_POLL_SECONDS:-5}"

common_usage() {
  cat <<EOF
Common options (flag, else environment variable, else default):
  --project P          GCP project            TPU_PROJECT   (default: gcloud config get-value project)
  --zone Z             zone                   TPU_ZONE      (default: per TPU family, see below)
  --type T             accelerator type       TPU_TYPE      (default: v5p-8; e.g. v5p-16, v5p-32,
                       v5litepod-8 (alias v5e-8), v6e-8, v6e-16, v4-8)
  --runtime R          TPU VM runtime version TPU_RUNTIME   (default: per TPU family, see below)
  --name N             TPU VM / node name     TPU_NAME      (default: dflash-tpu)
  --queued             use a queued resource  TPU_QUEUED=1  (create/delete/status)
  --qr-name Q          queued resource id     TPU_QR_NAME   (default: the --name)
  --num-slices K       multislice node count  TPU_NUM_SLICES (default 1; K>1 implies --queued and
                       nodes NAME-0 .. NAME-(K-1))
  --hosts H            hosts per slice, only for types this script does not know   TPU_HOSTS
  --remote-dir D       project dir on the VMs TPU_REMOTE_DIR (default: dflash-jax, under \$HOME)
  --venv V             venv on the VMs        TPU_VENV      (default: ~/dflash-venv)
  --python P           python on the VMs      TPU_PYTHON    (default: <venv>/bin/python)
  --dry-run            print the gcloud commands (prefixed "+ ") instead of running them;
                       needs neither gcloud nor a login                    TPU_DRY_RUN=1
  -h, --help           this help

Family defaults (current as of writing; check 'gcloud compute tpus accelerator-types list --zone Z'
and 'gcloud compute tpus tpu-vm versions list --zone Z', and override when they move):
  v5p        zone us-east5-a   runtime v2-alpha-tpuv5        (v5p-N: N TensorCores, 2 per chip, 4 chips per host)
  v5litepod  zone us-west4-a   runtime v2-alpha-tpuv5-lite   (v5e; N chips; 8 on one host, else 4 per host)
  v6e        zone us-east5-b   runtime v2-alpha-tpuv6e       (Trillium; N chips; 8 on one host, else 4 per host)
  v4         zone us-central2-b runtime tpu-ubuntu2204-base  (v4-N: N TensorCores, 2 per chip, 4 chips per host)

Exit codes: 0 ok, ${E_USAGE} usage, ${E_NO_GCLOUD} gcloud missing, ${E_NO_AUTH} not logged in, ${E_NO_PROJECT} no project,
            ${E_REMOTE} gcloud/remote command failed, ${E_TIMEOUT} queued resource failed or timed out.
EOF
}

# common_flag "$@": consume one common option. Returns 0 and sets FLAG_SHIFT when $1 is one,
# 1 otherwise. Needs a `usage` function in the calling script (for --help).
common_flag() {
  FLAG_SHIFT=1
  case "$1" in
    --project | --project=*) flag_value "$@"; PROJECT=${FLAG_VALUE} ;;
    --zone | --zone=*) flag_value "$@"; ZONE=${FLAG_VALUE} ;;
    --type | --type=* | --accelerator-type | --accelerator-type=*) flag_value "$@"; TYPE=${FLAG_VALUE} ;;
    --runtime | --runtime=* | --version | --version=*) flag_value "$@"; RUNTIME=${FLAG_VALUE} ;;
    --name | --name=*) flag_value "$@"; NAME=${FLAG_VALUE} ;;
    --qr-name | --qr-name=*) flag_value "$@"; QR_NAME=${FLAG_VALUE} ;;
    --queued) QUEUED=1 ;;
    --no-queued) QUEUED=0 ;;
    --num-slices | --num-slices=*) flag_value "$@"; NUM_SLICES=${FLAG_VALUE} ;;
    --hosts | --hosts=*) flag_value "$@"; HOSTS_OVERRIDE=${FLAG_VALUE} ;;
    --remote-dir | --remote-dir=*) flag_value "$@"; REMOTE_DIR=${FLAG_VALUE} ;;
    --venv | --venv=*) flag_value "$@"; VENV=${FLAG_VALUE} ;;
    --python | --python=*) flag_value "$@"; PYTHON=${FLAG_VALUE} ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    *) return 1 ;;
  esac
  return 0
}

# ----------------------------------------------------------------------------- derived settings
FAMILY=""
HOSTS=1
CHIPS=0
NODES=()

# tpu_topology: normalise TYPE, pick family defaults for ZONE/RUNTIME, count hosts and chips.
tpu_topology() {
  local t size default_zone="" default_runtime=""
  t=$(printf '%s' "${TYPE}" | tr '[:upper:]' '[:lower:]') # (no ${x,,}: macOS ships bash 3.2)
  [[ "${t}" =~ ^v5e-([0-9]+)$ ]] && t="v5litepod-${BASH_REMATCH[1]}"
  [[ "${t}" =~ ^(v[0-9]+[a-z]*)-([0-9]+)$ ]] ||
    usage_error "accelerator type '${TYPE}' is not of the form FAMILY-SIZE (e.g. v5p-8, v5p-32, v5litepod-8, v6e-8)"
  TYPE=${t}
  FAMILY=${BASH_REMATCH[1]}
  size=$((10#${BASH_REMATCH[2]}))
  ((size > 0)) || usage_error "accelerator type '${TYPE}' has size 0"
  case "${FAMILY}" in
    v5p | v4)
      ((size % 8 == 0)) || usage_error "${FAMILY} sizes count TensorCores in multiples of 8 (v5p-8, v5p-16, ...), got '${TYPE}'"
      CHIPS=$((size / 2))
      HOSTS=$((CHIPS / 4))
      if [[ "${FAMILY}" == v5p ]]; then
        default_zone=us-east5-a default_runtime=v2-alpha-tpuv5
      else
        default_zone=us-central2-b default_runtime=tpu-ubuntu2204-base
      fi
      ;;
    v5litepod | v6e)
      CHIPS=${size}
      if ((size <= 8)); then HOSTS=1; else HOSTS=$((size / 4)); fi
      if [[ "${FAMILY}" == v5litepod ]]; then
        default_zone=us-west4-a default_runtime=v2-alpha-tpuv5-lite
      else
        default_zone=us-east5-b default_runtime=v2-alpha-tpuv6e
      fi
      ;;
    *)
      [[ -n "${ZONE}" && -n "${RUNTIME}" ]] ||
        usage_error "no defaults for TPU family '${FAMILY}': pass --zone and --runtime (or TPU_ZONE / TPU_RUNTIME)"
      CHIPS=0
      HOSTS=1
      ;;
  esac
  if [[ -n "${HOSTS_OVERRIDE}" ]]; then
    require_uint --hosts "${HOSTS_OVERRIDE}" 1
    HOSTS=$((10#${HOSTS_OVERRIDE}))
  fi
  ZONE=${ZONE:-${default_zone}}
  RUNTIME=${RUNTIME:-${default_runtime}}
}

# tpu_finalize: validate everything, derive defaults, check gcloud/login/project (unless --dry-run).
tpu_finalize() {
  tpu_topology
  [[ "${NAME}" =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    usage_error "TPU name '${NAME}' must be lowercase letters, digits and '-', start with a letter, at most 63 characters"
  QR_NAME=${QR_NAME:-${NAME}}
  [[ "${QR_NAME}" =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    usage_error "queued resource id '${QR_NAME}' must be lowercase letters, digits and '-', start with a letter"
  require_uint --num-slices "${NUM_SLICES}" 1
  NUM_SLICES=$((10#${NUM_SLICES}))
  if ((NUM_SLICES > 1)) && ! is_true "${QUEUED}"; then
    info "--num-slices ${NUM_SLICES} needs a queued resource: using --queued"
    QUEUED=1
  fi
  [[ "${ZONE}" =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || usage_error "zone '${ZONE}' does not look like a GCP zone (e.g. us-east5-a)"
  [[ "${REMOTE_DIR}" =~ ^[A-Za-z0-9_./~-]+$ ]] || usage_error "--remote-dir '${REMOTE_DIR}' may only hold letters, digits and _ . / ~ -"
  PYTHON=${PYTHON:-${VENV%/}/bin/python}
  NODES=()
  if ((NUM_SLICES > 1)); then
    local i
    for ((i = 0; i < NUM_SLICES; i++)); do NODES+=("${NAME}-${i}"); done
  else
    NODES=("${NAME}")
  fi
  require_gcloud
  if ((HOSTS > 1 || NUM_SLICES > 1)); then
    info "${TYPE}: ${HOSTS} host(s) per slice x ${NUM_SLICES} slice(s), ${CHIPS} chip(s) per slice (multi-host: commands go to --worker=all)"
  fi
}

# require_gcloud: gcloud on PATH, an active account, a project. Skipped in --dry-run mode.
require_gcloud() {
  if is_true "${DRY_RUN}"; then
    [[ -n "${PROJECT}" ]] || info "dry run: no --project/TPU_PROJECT given, commands use gcloud's configured project"
    return 0
  fi
  command -v gcloud >/dev/null 2>&1 ||
    die "${E_NO_GCLOUD}" "gcloud not found on PATH. Install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install), or run with --dry-run to only print the commands."
  local account
  account=$(gcloud auth list --filter=status:ACTIVE '--format=value(account)' 2>/dev/null) || account=""
  [[ -n "${account//[[:space:]]/}" ]] ||
    die "${E_NO_AUTH}" "gcloud has no active account. Run 'gcloud auth login' (and 'gcloud config set project PROJECT'), then retry."
  if [[ -z "${PROJECT}" ]]; then
    PROJECT=$(gcloud config get-value project 2>/dev/null) || PROJECT=""
    PROJECT=${PROJECT//[[:space:]]/}
    [[ "${PROJECT}" != "(unset)" ]] || PROJECT=""
  fi
  [[ -n "${PROJECT}" ]] ||
    die "${E_NO_PROJECT}" "no GCP project: pass --project, set TPU_PROJECT, or run 'gcloud config set project PROJECT'."
}

# ----------------------------------------------------------------------------- gcloud runners
# gc ARGS...: print "+ gcloud ARGS" and run it (unless --dry-run).
gc() {
  if is_true "${DRY_RUN}"; then
    printf '+ %s\n' "$(shjoin gcloud "$@")"
    return 0
  fi
  printf '+ %s\n' "$(shjoin gcloud "$@")" >&2
  gcloud "$@"
}

# where_flags: --zone and --project flags for every TPU command.
where_flags() {
  WHERE=("--zone=${ZONE}")
  [[ -z "${PROJECT}" ]] || WHERE+=("--project=${PROJECT}")
}

# gc_each_node ARGS-WITH-@NODE@...: run one gcloud command per node, @NODE@ replaced by the node
# name. Several nodes (multislice) run concurrently, since a distributed job only starts once
# every slice has joined.
gc_each_node() {
  local node a pids=() failed=0 pid
  local -a argv
  for node in "${NODES[@]}"; do
    argv=()
    for a in "$@"; do argv+=("${a//@NODE@/${node}}"); done
    if ((${#NODES[@]} == 1)) || is_true "${DRY_RUN}"; then
      gc "${argv[@]}" || failed=1
    else
      gc "${argv[@]}" &
      pids+=("$!")
    fi
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    wait "${pid}" || failed=1
  done
  return "${failed}"
}

# tpu_ssh WORKER COMMAND: run a shell command string on WORKER (all, 0, 1-3, ...) of every node.
tpu_ssh() {
  local worker=$1 cmd=$2
  where_flags
  gc_each_node compute tpus tpu-vm ssh @NODE@ "${WHERE[@]}" "--worker=${worker}" "--command=${cmd}"
}

# tpu_ssh_first WORKER COMMAND: same, on the first node only (node 0 of a multislice).
tpu_ssh_first() {
  local worker=$1 cmd=$2
  where_flags
  gc compute tpus tpu-vm ssh "${NODES[0]}" "${WHERE[@]}" "--worker=${worker}" "--command=${cmd}"
}

# tpu_scp_to_all LOCAL REMOTE: copy a local file to REMOTE (relative to $HOME) on every worker.
tpu_scp_to_all() {
  where_flags
  gc_each_node compute tpus tpu-vm scp "$1" "@NODE@:$2" "${WHERE[@]}" --worker=all
}

# tpu_scp_from WORKER REMOTE LOCAL: recursive copy from one worker of the first node.
tpu_scp_from() {
  where_flags
  gc compute tpus tpu-vm scp --recurse "${NODES[0]}:$2" "$3" "${WHERE[@]}" "--worker=$1"
}

# remote_path P: P as seen from $HOME on a VM (relative paths live under --remote-dir).
remote_path() {
  case "$1" in
    /* | "~/"* | "~") printf '%s' "$1" ;;
    *) printf '%s/%s' "${REMOTE_DIR%/}" "$1" ;;
  esac
}

# ----------------------------------------------------------------------------- remote jobs
# Job options shared by the job scripts (run.sh, bench_published.sh, train_drafter.sh).
JOB_MODE="${TPU_JOB_MODE:-follow}" # follow | detach | foreground
JOB_LOG=""
JOB_ENV=()
DISTRIBUTED="${TPU_DISTRIBUTED:-auto}"

job_usage() {
  cat <<EOF
Job options:
  --foreground         run over a plain ssh session (the job dies if the connection drops)
  --detach             start the job with nohup on every worker and return at once
  (default)            start it with nohup on every worker, then stream worker 0's log until the
                       job ends and exit with its status            TPU_JOB_MODE=follow|detach|foreground
  --log NAME           log name: <remote-dir>/logs/NAME.log on each worker (exit status in NAME.log.rc)
  --env K=V            export K=V before the command (repeatable)
  --distributed        call jax.distributed.initialize(): pass --distributed and DFLASH_DISTRIBUTED=1
  --no-distributed     never pass it          TPU_DISTRIBUTED=auto|1|0 (auto: on for multi-host slices)
EOF
}

# job_flag "$@": like common_flag, for the job options.
job_flag() {
  FLAG_SHIFT=1
  case "$1" in
    --foreground) JOB_MODE=foreground ;;
    --detach | --background) JOB_MODE=detach ;;
    --follow) JOB_MODE=follow ;;
    --log | --log=*) flag_value "$@"; JOB_LOG=${FLAG_VALUE} ;;
    --env | --env=*)
      flag_value "$@"
      [[ "${FLAG_VALUE}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || usage_error "--env wants KEY=VALUE, got '${FLAG_VALUE}'"
      JOB_ENV+=("${FLAG_VALUE}")
      ;;
    --distributed) DISTRIBUTED=1 ;;
    --no-distributed) DISTRIBUTED=0 ;;
    *) return 1 ;;
  esac
  return 0
}

# job_finalize DEFAULT_LOG: validate job options (after tpu_finalize).
job_finalize() {
  JOB_LOG=${JOB_LOG:-$1}
  [[ "${JOB_LOG}" =~ ^[A-Za-z0-9_.-]+$ ]] || usage_error "--log '${JOB_LOG}' may only hold letters, digits, '_', '.', '-'"
  case "${JOB_MODE}" in
    follow | detach | foreground) ;;
    *) usage_error "TPU_JOB_MODE must be follow, detach or foreground, got '${JOB_MODE}'" ;;
  esac
  case "${DISTRIBUTED}" in
    auto) if ((HOSTS > 1 || NUM_SLICES > 1)); then DISTRIBUTED=1; else DISTRIBUTED=0; fi ;;
    1 | true | yes) DISTRIBUTED=1 ;;
    0 | false | no) DISTRIBUTED=0 ;;
    *) usage_error "TPU_DISTRIBUTED must be auto, 1 or 0, got '${DISTRIBUTED}'" ;;
  esac
  if ((DISTRIBUTED)); then JOB_ENV+=("DFLASH_DISTRIBUTED=1"); fi
}

# job_env_prefix: "export K=V && " for the job's environment (empty when none).
job_env_prefix() {
  local kv out=""
  for kv in ${JOB_ENV[@]+"${JOB_ENV[@]}"}; do
    out+="export ${kv%%=*}=$(shq "${kv#*=}") && "
  done
  printf '%s' "${out}"
}

# launch_command BODY: remote command that starts BODY (a shell snippet, run inside --remote-dir)
# under nohup, logging to logs/<log>.log and writing its exit status to logs/<log>.log.rc.
launch_command() {
  local body=$1 log="logs/${JOB_LOG}.log"
  # shellcheck disable=SC2016  # $(hostname) and $! expand on the VM
  printf 'cd %s || exit 1; mkdir -p logs && rm -f %s.rc; nohup bash -c %s > %s 2>&1 < /dev/null & echo "started %s on $(hostname) as pid $!"' \
    "$(shq "${REMOTE_DIR}")" "${log}" "$(shq "( ${body} ); echo \$? > ${log}.rc")" "${log}" "${log}"
}

# follow_command: remote command that streams logs/<log>.log until its .rc file appears and then
# exits with the job's status.
follow_command() {
  local log="logs/${JOB_LOG}.log"
  # shellcheck disable=SC2016  # $f, $t, $i expand on the VM
  printf 'cd %s || exit 1; f=%s; i=0; while [ ! -e "$f" ] && [ "$i" -lt 120 ]; do sleep 1; i=$((i+1)); done; [ -e "$f" ] || { echo "no log $f" >&2; exit 1; }; tail -n +1 -F "$f" & t=$!; while [ ! -e "$f.rc" ]; do sleep %s; done; sleep 1; kill "$t" 2>/dev/null; rc=$(cat "$f.rc"); echo "[job ${f} finished with status $rc]"; exit "$rc"' \
    "$(shq "${REMOTE_DIR}")" "${log}" "$(shq "${FOLLOW_POLL_SECONDS}")"
}

# run_job BODY: run BODY on every worker of every node according to JOB_MODE.
run_job() {
  local body
  body="$(job_env_prefix)$1"
  case "${JOB_MODE}" in
    foreground)
      tpu_ssh all "cd $(shq "${REMOTE_DIR}") || exit 1; ${body}" || die "${E_REMOTE}" "the job failed on at least one worker"
      ;;
    detach | follow)
      tpu_ssh all "$(launch_command "${body}")" || die "${E_REMOTE}" "could not start the job on every worker"
      if [[ "${JOB_MODE}" == detach ]]; then
        info "started in the background; stream it with: tpu_scripts/logs.sh --name ${NAME} --log ${JOB_LOG}"
      else
        tpu_ssh_first 0 "$(follow_command)" || die "${E_REMOTE}" "the job failed (worker 0 log: $(remote_path "logs/${JOB_LOG}.log"))"
      fi
      ;;
  esac
}
