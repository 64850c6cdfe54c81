#!/usr/bin/env bash
# Put the project on every worker of the TPU VM (tarball of this checkout, or git clone) and
# install it with its TPU extras (jax[tpu]) into a Python >= 3.11 virtual environment.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"

GIT_URL="${TPU_GIT_URL:-}"
GIT_REF="${TPU_GIT_REF:-}"
DATA_DIR="${TPU_DATA_DIR:-}"
EXTRAS="${TPU_EXTRAS:-tpu,hub}"
PY_VERSION="${TPU_PYTHON_VERSION:-3.12}"
SYSTEM_PYTHON="${TPU_SYSTEM_PYTHON:-0}"
DO_COPY=1
DO_INSTALL=1
DO_CHECK=1

usage() {
  cat <<EOF
Usage: ${SCRIPT_NAME} [options]

1. copy: tar this checkout (the files git tracks plus untracked, non-ignored ones; no .git),
   scp it to every worker (--worker=all) and unpack it into ~/<remote-dir>;
   or, with --git URL, git clone/fetch URL on every worker instead;
   with --data DIR also copy DIR to ~/shared/data (the repo's ../shared/data);
2. install: on every worker, create a venv (uv, Python ${PY_VERSION}: the TPU images ship Python 3.10,
   and current jax needs >= 3.11) and run  python -m pip install -e '.[${EXTRAS}]'  (jax[tpu], libtpu);
3. check: print jax's local TPU devices on every worker.

Options:
  --git URL            clone URL on the workers instead of copying this checkout   TPU_GIT_URL
  --ref REF            branch, tag or commit to check out (with --git)              TPU_GIT_REF
  --data DIR           also copy local DIR to ~/shared/data on every worker         TPU_DATA_DIR
  --extras E           pip extras to install (default: tpu,hub)                     TPU_EXTRAS
  --python-version V   venv Python version (default: 3.12)                          TPU_PYTHON_VERSION
  --system-python      no venv: pip install --user with the image's python3 (jobs then need
                       --python python3)                                            TPU_SYSTEM_PYTHON=1
  --no-copy | --no-install | --no-check   skip a step

$(common_usage)
EOF
}

while [[ $# -gt 0 ]]; do
  if common_flag "$@"; then shift "${FLAG_SHIFT}"; continue; fi
  case "$1" in
    --git | --git=*) flag_value "$@"; GIT_URL=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --ref | --ref=*) flag_value "$@"; GIT_REF=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --data | --data=*) flag_value "$@"; DATA_DIR=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --extras | --extras=*) flag_value "$@"; EXTRAS=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --python-version | --python-version=*) flag_value "$@"; PY_VERSION=${FLAG_VALUE}; shift "${FLAG_SHIFT}"; continue ;;
    --system-python) SYSTEM_PYTHON=1 ;;
    --no-copy) DO_COPY=0 ;;
    --no-install) DO_INSTALL=0 ;;
    --no-check) DO_CHECK=0 ;;
    *) usage_error "unknown option '$1'" ;;
  esac
  shift
done
[[ "${EXTRAS}" =~ ^[a-z0-9_-]+(,[a-z0-9_-]+)*$ ]] || usage_error "--extras '${EXTRAS}' must be a comma-separated list like tpu,hub"
[[ "${PY_VERSION}" =~ ^3\.[0-9]+$ ]] || usage_error "--python-version '${PY_VERSION}' must look like 3.12"
[[ -z "${GIT_REF}" || -n "${GIT_URL}" ]] || usage_error "--ref needs --git URL"
if [[ -n "${DATA_DIR}" && ! -d "${DATA_DIR}" ]]; then usage_error "--data '${DATA_DIR}' is not a directory"; fi
if is_true "${SYSTEM_PYTHON}" && [[ -z "${PYTHON}" ]]; then PYTHON=python3; fi
tpu_finalize

rdir=$(shq "${REMOTE_DIR}")
tmpdir=""
cleanup() { [[ -z "${tmpdir}" ]] || rm -rf "${tmpdir}"; }
trap cleanup EXIT

# make_tarball SRC_DIR OUT [repo]: gzip tarball of SRC_DIR (for the repo: git's file list).
make_tarball() {
  local src=$1 out=$2 kind=${3:-}
  if [[ "${kind}" == repo ]] && command -v git >/dev/null 2>&1 && git -C "${src}" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    local f list=()
    while IFS= read -r -d '' f; do
      case "${f}" in
        .git/* | */__pycache__/* | __pycache__/* | *.pyc | results/* | checkpoints/* | logs/* | runs/* | outputs/* | *.tar.gz | .gl/*) continue ;;
      esac
      [[ -e "${src}/${f}" || -L "${src}/${f}" ]] && list+=("${f}")
    done < <(git -C "${src}" ls-files -z --cached --others --exclude-standard)
    ((${#list[@]} > 0)) || die "${E_USAGE}" "no files to copy from ${src}"
    printf '%s\0' "${list[@]}" | COPYFILE_DISABLE=1 tar -czf "${out}" -C "${src}" --null -T -
  else
    COPYFILE_DISABLE=1 tar -czf "${out}" -C "${src}" --exclude=.git --exclude=__pycache__ --exclude='*.pyc' \
      --exclude='*.egg-info' --exclude=.venv --exclude=results --exclude=checkpoints --exclude=logs --exclude='*.tar.gz' .
  fi
}

# copy_dir SRC REMOTE_DEST_DIR TARBALL_NAME [repo]
copy_dir() {
  local src=$1 dest=$2 name=$3 kind=${4:-} tarball
  if is_true "${DRY_RUN}"; then
    tarball="${TMPDIR:-/tmp}/dflash-tpu.XXXXXX/${name}"
    printf '# locally: tar -czf %s -C %s <files>\n' "${tarball}" "$(shq "${src}")"
  else
    tmpdir=${tmpdir:-$(mktemp -d "${TMPDIR:-/tmp}/dflash-tpu.XXXXXX")}
    tarball="${tmpdir}/${name}"
    make_tarball "${src}" "${tarball}" "${kind}"
    info "packed ${src} into ${tarball} ($(wc -c <"${tarball}" | tr -d ' ') bytes)"
  fi
  tpu_scp_to_all "${tarball}" "${name}" || die "${E_REMOTE}" "copying ${name} to the workers failed"
  tpu_ssh all "mkdir -p $(shq "${dest}") && tar -xzf ${name} -C $(shq "${dest}") && rm -f ${name}" ||
    die "${E_REMOTE}" "unpacking ${name} on the workers failed"
}

if ((DO_COPY)); then
  if [[ -n "${GIT_URL}" ]]; then
    info "cloning ${GIT_URL}${GIT_REF:+ @ ${GIT_REF}} into ~/${REMOTE_DIR} on every worker"
    if [[ -n "${GIT_REF}" ]]; then
      update="git -C ${rdir} fetch --quiet origin && git -C ${rdir} checkout --quiet $(shq "${GIT_REF}")"
    else
      update="git -C ${rdir} pull --quiet --ff-only"
    fi
    clone="if [ -d ${rdir}/.git ]; then ${update}; else git clone --quiet $(shq "${GIT_URL}") ${rdir}"
    [[ -z "${GIT_REF}" ]] || clone+=" && git -C ${rdir} checkout --quiet $(shq "${GIT_REF}")"
    clone+="; fi"
    tpu_ssh all "${clone}" || die "${E_REMOTE}" "git clone/fetch failed on a worker (private repo? pass a URL the VMs can read)"
  else
    info "copying ${TPU_REPO_ROOT} to ~/${REMOTE_DIR} on every worker"
    copy_dir "${TPU_REPO_ROOT}" "${REMOTE_DIR}" dflash-jax-src.tar.gz repo
  fi
  if [[ -n "${DATA_DIR}" ]]; then
    info "copying ${DATA_DIR} to ~/shared/data on every worker"
    copy_dir "${DATA_DIR}" shared/data dflash-jax-data.tar.gz
  fi
fi

py=$(shq "${PYTHON}")
if ((DO_INSTALL)); then
  spec=$(shq ".[${EXTRAS}]")
  if is_true "${SYSTEM_PYTHON}"; then
    install="cd ${rdir} && ${py} -m pip install --user --upgrade pip && ${py} -m pip install --user -e ${spec}"
  else
    venv=$(shq "${VENV%/}")
    install="cd ${rdir} && if [ ! -x ${venv}/bin/python ]; then python3 -m pip install --user --quiet --upgrade uv && ~/.local/bin/uv venv --seed --python $(shq "${PY_VERSION}") ${venv}; fi && ${py} -m pip install --quiet --upgrade pip && ${py} -m pip install -e ${spec}"
  fi
  info "installing dflash-jax[${EXTRAS}] on every worker (a few minutes)"
  tpu_ssh all "${install}" || die "${E_REMOTE}" "pip install failed on a worker (see the output above)"
fi

if ((DO_CHECK)); then
  pycheck='import jax; @INIT@import dflash_jax; print("jax", jax.__version__, "process", jax.process_index(), "local devices", jax.local_device_count(), jax.local_devices()[0].device_kind, "global devices", jax.device_count())'
  init=""
  ((HOSTS * NUM_SLICES == 1)) || init="jax.distributed.initialize(); "
  check="cd ${rdir} && ${py} -c $(shq "${pycheck//@INIT@/${init}}")"
  tpu_ssh all "${check}" || die "${E_REMOTE}" "the jax TPU check failed on a worker"
fi
is_true "${DRY_RUN}" || info "done: run jobs with tpu_scripts/run.sh, bench_published.sh or train_drafter.sh"
