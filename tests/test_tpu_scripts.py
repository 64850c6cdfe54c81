"""Tests for the Cloud TPU scripts in tpu_scripts/ (no cloud access needed).

A fake `gcloud` (a small Python script put first on PATH) appends each call's argv to a JSON-lines
log and prints plausible output for `auth list`, `config get-value project` and queued-resource
`describe`. With FAKE_TPU_HOME set it also plays a one-worker TPU VM: `tpu-vm ssh --command=C` runs
C with bash in that directory (as $HOME), and `tpu-vm scp` copies files to and from it, so the
scripts' nested shell quoting, nohup/tail logic and exit statuses are exercised for real.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = REPO / "tpu_scripts"
ALL_SCRIPTS = sorted(SCRIPTS_DIR.glob("*.sh"))
RUNNABLE = [p.name for p in ALL_SCRIPTS if p.name != "common.sh"]
EXPECTED_SCRIPTS = {
    "common.sh", "create.sh", "setup.sh", "run.sh", "logs.sh", "fetch.sh", "delete.sh", "status.sh",
    "bench_published.sh", "train_drafter.sh",
}
DATASETS = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]

FAKE_GCLOUD = r'''#!__PYTHON__
import json, os, shutil, subprocess, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
home = os.environ.get("FAKE_TPU_HOME")

def flag(name):
    for a in args:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None

if args[:2] == ["auth", "list"]:
    acct = os.environ.get("FAKE_GCLOUD_ACCOUNT", "tester@example.com")
    if acct:
        print(acct)
    sys.exit(0)
if args[:3] == ["config", "get-value", "project"]:
    proj = os.environ.get("FAKE_GCLOUD_PROJECT", "fake-project")
    if proj:
        print(proj)
    else:
        print("(unset)", file=sys.stderr)
    sys.exit(0)
if args[:4] == ["compute", "tpus", "queued-resources", "describe"] and flag("--format"):
    states = os.environ.get("FAKE_GCLOUD_QR_STATES", "ACTIVE").split(",")
    counter = Path(os.environ["FAKE_GCLOUD_LOG"] + ".qr")
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    print(states[min(n, len(states) - 1)])
    sys.exit(0)
if args[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and home:
    r = subprocess.run(["bash", "-c", flag("--command")], cwd=home, env=dict(os.environ, HOME=home))
    sys.exit(r.returncode)
if args[:4] == ["compute", "tpus", "tpu-vm", "scp"] and home:
    paths = [a for a in args[4:] if not a.startswith("--")]
    src, dst = paths[0], paths[-1]
    if ":" in dst:  # upload
        shutil.copy(src, Path(home) / dst.split(":", 1)[1])
    else:  # download (--recurse)
        s = Path(home) / src.split(":", 1)[1]
        target = Path(dst) / s.name
        if s.is_dir():
            shutil.copytree(s, target, dirs_exist_ok=True)
        else:
            shutil.copy(s, target)
    sys.exit(0)
sys.exit(int(os.environ.get("FAKE_GCLOUD_RC", "0")))
'''

FAKE_PYTHON = r'''#!/usr/bin/env bash
# stands for ~/dflash-venv/bin/python on the fake TPU VM: records argv, writes a result file
{ printf '%s\t' "$@"; printf '\n'; } >> "$HOME/python_calls.tsv"
out="" prev=""
for a in "$@"; do
  if [ "$prev" = "--out" ]; then out=$a; fi
  prev=$a
done
if [ -n "$out" ]; then mkdir -p "$out" && echo '{"tokens_per_second": 123.4}' > "$out/summary.json"; fi
echo "fake python: $*"
exit "${FAKE_PY_RC:-0}"
'''


# ----------------------------------------------------------------------------- helpers
class Env:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.log = tmp / "gcloud.log"
        gcloud = self.bin / "gcloud"
        gcloud.write_text(FAKE_GCLOUD.replace("__PYTHON__", sys.executable))
        gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
        self.base = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "DFLASH_", "FAKE_"))}
        self.base.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            FAKE_GCLOUD_LOG=str(self.log),
            TPU_POLL_SECONDS="0",
            TPU_FOLLOW_POLL_SECONDS="1",
            TMPDIR=str(tmp),
        )

    def run(self, script: str, *args: str, env: dict | None = None, path: str | None = None, timeout=60):
        e = dict(self.base, **(env or {}))
        if path is not None:
            e["PATH"] = path
        if self.log.exists():
            self.log.unlink()
        return subprocess.run(
            [str(SCRIPTS_DIR / script), *args], env=e, cwd=self.tmp, capture_output=True, text=True,
            timeout=timeout,
        )

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def tpu_calls(self) -> list[list[str]]:
        """gcloud calls other than the preflight auth/config queries."""
        return [c for c in self.calls() if c[:1] not in (["auth"], ["config"])]


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


def dry_commands(stdout: str) -> list[list[str]]:
    """The `+ gcloud ...` lines of a dry run, parsed like a shell would (without the 'gcloud')."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("+ "):
            words = shlex.split(line[2:])
            assert words[0] == "gcloud", line
            out.append(words[1:])
    return out


def remote_command(call: list[str]) -> str:
    cmds = [a.split("=", 1)[1] for a in call if a.startswith("--command=")]
    assert len(cmds) == 1, call
    return cmds[0]


def ssh_calls(calls):
    return [c for c in calls if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]]


def scp_calls(calls):
    return [c for c in calls if c[:4] == ["compute", "tpus", "tpu-vm", "scp"]]


@pytest.fixture(scope="module")
def no_gcloud_path(tmp_path_factory) -> str:
    """A PATH holding every program of the current PATH except gcloud."""
    d = tmp_path_factory.mktemp("nogcloud-bin")
    for p in os.environ.get("PATH", "").split(os.pathsep):
        if not p or not os.path.isdir(p):
            continue
        for f in os.listdir(p):
            if f.startswith("gcloud") or (d / f).exists() or (d / f).is_symlink():
                continue
            full = os.path.join(p, f)
            if os.path.isfile(full) and os.access(full, os.X_OK):
                (d / f).symlink_to(full)
    assert not (d / "gcloud").exists()
    return str(d)


def assert_usage_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    for w in words:
        assert w in r.stderr, (w, r.stderr)


# ----------------------------------------------------------------------------- static checks
def test_expected_scripts_present():
    assert EXPECTED_SCRIPTS <= {p.name for p in ALL_SCRIPTS}


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("the `shellcheck` binary is not installed (CI installs it with apt-get install shellcheck)")
    r = subprocess.run(
        ["shellcheck", "-x", "-P", "SCRIPTDIR", *map(str, ALL_SCRIPTS)], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", sorted(EXPECTED_SCRIPTS))
def test_strict_header(script):
    text = (SCRIPTS_DIR / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert re.search(r"^set -euo pipefail$", text, re.M)
    mode = (SCRIPTS_DIR / script).stat().st_mode
    if script != "common.sh":
        assert mode & stat.S_IXUSR, f"{script} is not executable"
        assert 'common.sh"' in text


def test_common_sh_refuses_to_run(env):
    r = subprocess.run(["bash", str(SCRIPTS_DIR / "common.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "library" in r.stderr


@pytest.mark.parametrize("script", RUNNABLE)
def test_help(env, script, no_gcloud_path):
    r = env.run(script, "--help", path=no_gcloud_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Usage: {script}")
    for flag in ("--dry-run", "--project", "--zone", "--type", "--runtime", "--name", "TPU_PROJECT"):
        assert flag in r.stdout, flag
    assert env.calls() == []


# ----------------------------------------------------------------------------- preflight
@pytest.mark.parametrize("script,args", [
    ("create.sh", []), ("delete.sh", []), ("setup.sh", []), ("run.sh", ["--", "true"]),
    ("bench_published.sh", []), ("train_drafter.sh", ["--config", "c.yaml"]), ("fetch.sh", []),
    ("logs.sh", []), ("status.sh", []),
])
def test_missing_gcloud_is_a_clear_error(env, no_gcloud_path, script, args):
    r = env.run(script, *args, path=no_gcloud_path)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "gcloud not found on PATH" in r.stderr and "--dry-run" in r.stderr
    assert "+ gcloud" not in r.stdout


def test_dry_run_needs_neither_gcloud_nor_login(env, no_gcloud_path):
    r = env.run("create.sh", "--dry-run", path=no_gcloud_path)
    assert r.returncode == 0, r.stderr
    assert dry_commands(r.stdout) == [
        ["compute", "tpus", "tpu-vm", "create", "dflash-tpu", "--zone=us-east5-a",
         "--accelerator-type=v5p-8", "--version=v2-alpha-tpuv5"]]
    # with the fake gcloud on PATH a dry run still calls nothing, not even `auth list`
    r = env.run("create.sh", "--dry-run", env={"FAKE_GCLOUD_ACCOUNT": ""})
    assert r.returncode == 0 and env.calls() == []


def test_no_active_account_is_a_clear_error(env):
    r = env.run("create.sh", env={"FAKE_GCLOUD_ACCOUNT": ""})
    assert r.returncode == 4, r.stderr
    assert "no active account" in r.stderr and "gcloud auth login" in r.stderr
    assert env.calls() == [["auth", "list", "--filter=status:ACTIVE", "--format=value(account)"]]


def test_no_project_is_a_clear_error(env):
    r = env.run("create.sh", env={"FAKE_GCLOUD_PROJECT": ""})
    assert r.returncode == 5, r.stderr
    assert "--project" in r.stderr and "TPU_PROJECT" in r.stderr
    assert env.tpu_calls() == []


def test_failed_gcloud_command_gives_nonzero_exit(env):
    r = env.run("create.sh", env={"FAKE_GCLOUD_RC": "1"})
    assert r.returncode == 6 and "creating TPU VM dflash-tpu failed" in r.stderr


# ----------------------------------------------------------------------------- create
def test_create_single_host_defaults_real_mode(env):
    r = env.run("create.sh")
    assert r.returncode == 0, r.stderr
    assert env.calls()[0][:2] == ["auth", "list"]
    assert env.tpu_calls() == [
        ["compute", "tpus", "tpu-vm", "create", "dflash-tpu", "--zone=us-east5-a", "--project=fake-project",
         "--accelerator-type=v5p-8", "--version=v2-alpha-tpuv5"]]


def test_create_spot_and_extra_flags(env):
    r = env.run("create.sh", "--spot", "--name", "my-tpu", "--gcloud-flag=--reserved")
    assert r.returncode == 0, r.stderr
    (call,) = env.tpu_calls()
    assert call[4] == "my-tpu" and "--spot" in call and call[-1] == "--reserved"
    r = env.run("create.sh", env={"TPU_SPOT": "1"})
    assert "--spot" in env.tpu_calls()[0]


@pytest.mark.parametrize("type_,zone,runtime,canonical", [
    ("v5p-8", "us-east5-a", "v2-alpha-tpuv5", "v5p-8"),
    ("v5e-8", "us-west4-a", "v2-alpha-tpuv5-lite", "v5litepod-8"),
    ("v5litepod-4", "us-west4-a", "v2-alpha-tpuv5-lite", "v5litepod-4"),
    ("v6e-8", "us-east5-b", "v2-alpha-tpuv6e", "v6e-8"),
    ("V6E-16", "us-east5-b", "v2-alpha-tpuv6e", "v6e-16"),
])
def test_family_defaults(env, type_, zone, runtime, canonical):
    r = env.run("create.sh", "--dry-run", "--type", type_)
    assert r.returncode == 0, r.stderr
    (call,) = dry_commands(r.stdout)
    assert f"--zone={zone}" in call and f"--version={runtime}" in call
    assert f"--accelerator-type={canonical}" in call


def test_env_and_flags_override_defaults(env):
    e = {"TPU_PROJECT": "envproj", "TPU_ZONE": "europe-west4-a", "TPU_TYPE": "v6e-8",
         "TPU_RUNTIME": "v2-alpha-tpuv6e-custom", "TPU_NAME": "env-tpu"}
    r = env.run("create.sh", "--dry-run", env=e)
    (call,) = dry_commands(r.stdout)
    assert call == ["compute", "tpus", "tpu-vm", "create", "env-tpu", "--zone=europe-west4-a", "--project=envproj",
                    "--accelerator-type=v6e-8", "--version=v2-alpha-tpuv6e-custom"]
    r = env.run("create.sh", "--dry-run", "--zone=us-central1-a", "--runtime", "rt-x", "--project", "flagproj",
                "--name=flag-tpu", env=e)
    (call,) = dry_commands(r.stdout)
    assert call[4] == "flag-tpu"
    assert {"--zone=us-central1-a", "--version=rt-x", "--project=flagproj"} <= set(call)


def test_create_queued_multihost_waits_for_active(env):
    r = env.run("create.sh", "--type", "v5p-32", "--queued", "--spot",
                env={"FAKE_GCLOUD_QR_STATES": "WAITING_FOR_RESOURCES,PROVISIONING,ACTIVE"})
    assert r.returncode == 0, r.stderr
    calls = env.tpu_calls()
    assert calls[0] == [
        "compute", "tpus", "queued-resources", "create", "dflash-tpu", "--zone=us-east5-a", "--project=fake-project",
        "--accelerator-type=v5p-32", "--runtime-version=v2-alpha-tpuv5", "--node-id=dflash-tpu", "--spot"]
    describe = ["compute", "tpus", "queued-resources", "describe", "dflash-tpu", "--zone=us-east5-a",
                "--project=fake-project", "--format=value(state.state)"]
    assert calls[1:] == [describe] * 3
    assert "4 host(s)" in r.stderr and "PROVISIONING" in r.stderr


def test_create_queued_failure_and_timeout(env):
    r = env.run("create.sh", "--queued", env={"FAKE_GCLOUD_QR_STATES": "PROVISIONING,FAILED"})
    assert r.returncode == 7 and "FAILED" in r.stderr
    r = env.run("create.sh", "--queued", "--wait-timeout", "0", env={"FAKE_GCLOUD_QR_STATES": "WAITING_FOR_RESOURCES"})
    assert r.returncode == 7 and "still WAITING_FOR_RESOURCES" in r.stderr
    r = env.run("create.sh", "--queued", "--no-wait")
    assert r.returncode == 0 and len(env.tpu_calls()) == 1


def test_create_multislice_uses_node_count(env):
    r = env.run("create.sh", "--dry-run", "--type", "v5p-16", "--num-slices", "2", "--project", "p")
    assert r.returncode == 0, r.stderr
    create = dry_commands(r.stdout)[0]
    assert create[:5] == ["compute", "tpus", "queued-resources", "create", "dflash-tpu"]
    assert "--node-count=2" in create and "--node-prefix=dflash-tpu" in create
    assert not any(a.startswith("--node-id") for a in create)


# ----------------------------------------------------------------------------- delete / status / fetch
def test_delete(env):
    r = env.run("delete.sh", "--name", "old-tpu", "--zone", "us-east5-a")
    assert r.returncode == 0, r.stderr
    assert env.tpu_calls() == [
        ["compute", "tpus", "tpu-vm", "delete", "old-tpu", "--zone=us-east5-a", "--project=fake-project", "--quiet"]]
    r = env.run("delete.sh", "--queued", "--type", "v5p-32")
    assert env.tpu_calls() == [
        ["compute", "tpus", "queued-resources", "delete", "dflash-tpu", "--zone=us-east5-a", "--project=fake-project",
         "--force", "--quiet"]]
    r = env.run("delete.sh", "--dry-run", "--qr-name", "my-qr", env={"TPU_QUEUED": "1"})
    assert dry_commands(r.stdout)[0][:5] == ["compute", "tpus", "queued-resources", "delete", "my-qr"]


def test_status_and_fetch(env, tmp_path):
    r = env.run("status.sh")
    assert r.returncode == 0
    assert [c[:5] for c in env.tpu_calls()] == [
        ["compute", "tpus", "tpu-vm", "describe", "dflash-tpu"], ["compute", "tpus", "tpu-vm", "list", "--zone=us-east5-a"]]
    r = env.run("fetch.sh", "--from", "results/published", "--to", str(tmp_path / "got"))
    assert r.returncode == 0, r.stderr
    assert env.tpu_calls() == [
        ["compute", "tpus", "tpu-vm", "scp", "--recurse", "dflash-tpu:dflash-jax/results/published",
         str(tmp_path / "got"), "--zone=us-east5-a", "--project=fake-project", "--worker=0"]]
    r = env.run("fetch.sh", "--from", "gs://bucket/x", "--to", "out")
    assert env.tpu_calls() == [["storage", "cp", "--recursive", "gs://bucket/x", "out"]]


# ----------------------------------------------------------------------------- dry run == real run
SCENARIOS = {
    "create": ("create.sh", ["--spot"]),
    "create-queued-v5p-32": ("create.sh", ["--type", "v5p-32", "--queued", "--spot"]),
    "create-multislice": ("create.sh", ["--num-slices", "2", "--type", "v6e-16"]),
    "setup-v5p-8": ("setup.sh", []),
    "setup-v5p-32": ("setup.sh", ["--type", "v5p-32", "--data", str(SCRIPTS_DIR)]),
    "setup-v5p-32-git": ("setup.sh", ["--type", "v5p-32", "--git", "https://example.com/x.git", "--ref", "v1"]),
    "setup-system-python": ("setup.sh", ["--system-python", "--no-copy"]),
    "run": ("run.sh", ["--", "python", "-c", "print('hi there')"]),
    "run-foreground-v5p-32": ("run.sh", ["--type", "v5p-32", "--foreground", "--env", "A=b c", "--", "echo hi"]),
    "run-multislice": ("run.sh", ["--num-slices", "2", "--foreground", "--", "hostname"]),
    "bench-v5p-8": ("bench_published.sh", ["--max-samples", "7"]),
    "bench-v5p-32": ("bench_published.sh", ["--type", "v5p-32", "--fetch", "res", "--", "--temperature", "0"]),
    "train-v5p-32": ("train_drafter.sh", ["--type", "v5p-32", "--config", "configs/x.yaml", "--bucket", "my-bkt",
                                          "--resume", "--", "optimizer.lr=1e-4"]),
    "logs": ("logs.sh", ["--log", "train"]),
    "fetch": ("fetch.sh", ["--to", "somewhere"]),
    "delete": ("delete.sh", []),
    "delete-queued": ("delete.sh", ["--queued"]),
    "status-queued": ("status.sh", ["--queued"]),
}


def _norm(calls):
    tar = re.compile(r"^/.*/dflash-jax-(src|data)\.tar\.gz$")
    return [["<tarball>" if tar.match(a) else a for a in c] for c in calls]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_dry_run_prints_exactly_what_real_mode_runs(env, name):
    script, args = SCENARIOS[name]
    e = {"TPU_PROJECT": "fake-project"}
    real = env.run(script, *args, env=e)
    assert real.returncode == 0, real.stderr
    real_calls = env.tpu_calls()
    dry = env.run(script, "--dry-run", *args, env=e)
    assert dry.returncode == 0, dry.stderr
    assert env.calls() == []
    printed = dry_commands(dry.stdout)
    # queued create: real mode polls `describe` until ACTIVE, dry run prints it once.
    # Multislice ssh calls run concurrently, so their order is free.
    if "--num-slices" in args and script == "run.sh":
        printed, real_calls = sorted(printed), sorted(real_calls)
    assert _norm(printed) == _norm(real_calls)
    assert printed, "no gcloud command printed"
    # every printed line is one command: no stray lines besides comments
    for line in dry.stdout.splitlines():
        assert line.startswith(("+ gcloud ", "# ")), line
    # and every remote command is valid shell
    for c in ssh_calls(real_calls):
        r = subprocess.run(["bash", "-n", "-c", remote_command(c)], capture_output=True, text=True)
        assert r.returncode == 0, (remote_command(c), r.stderr)


def test_setup_commands(env):
    r = env.run("setup.sh", "--dry-run", "--data", str(REPO / "tpu_scripts"))
    assert r.returncode == 0, r.stderr
    calls = dry_commands(r.stdout)
    scps = scp_calls(calls)
    assert [c[4:6] for c in scps] == [
        [scps[0][4], "dflash-tpu:dflash-jax-src.tar.gz"], [scps[1][4], "dflash-tpu:dflash-jax-data.tar.gz"]]
    assert all("--worker=all" in c for c in calls)
    install = [remote_command(c) for c in ssh_calls(calls) if "pip install" in remote_command(c)]
    assert len(install) == 1
    words = shlex.split(install[0].replace(";", " ; ").replace("&&", " && "))
    i = words.index("-e")
    assert words[i - 2:i] == ["pip", "install"] and words[i + 1] == ".[tpu,hub]"
    assert "uv venv --seed --python 3.12 ~/dflash-venv" in install[0]
    r = env.run("setup.sh", "--dry-run", "--system-python", "--extras", "tpu", "--no-copy", "--no-check")
    (cmd,) = [remote_command(c) for c in dry_commands(r.stdout)]
    assert "python3 -m pip install --user -e '.[tpu]'" in cmd and "venv" not in cmd


# ----------------------------------------------------------------------------- multi-host
@pytest.mark.parametrize("name", ["setup-v5p-32", "setup-v5p-32-git", "run-foreground-v5p-32", "bench-v5p-32",
                                  "train-v5p-32"])
def test_multihost_commands_go_to_all_workers(env, name):
    script, args = SCENARIOS[name]
    r = env.run(script, "--dry-run", *args)
    assert r.returncode == 0, r.stderr
    calls = dry_commands(r.stdout)
    assert "4 host(s)" in r.stderr
    for c in calls:
        cmd = remote_command(c) if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] else ""
        follow = "tail -n +1 -F" in cmd
        fetch = "--recurse" in c
        if follow or fetch:
            assert "--worker=0" in c, c  # logs and results come from worker 0
        else:
            assert "--worker=all" in c, c
    body = " ".join(remote_command(c) for c in ssh_calls(calls))
    if script in ("bench_published.sh", "train_drafter.sh"):
        assert "--distributed" in body and "DFLASH_DISTRIBUTED=1" in body
    elif script == "run.sh":  # an arbitrary command only gets the environment variable
        assert "export DFLASH_DISTRIBUTED=1 && echo hi" in body
    else:
        assert "jax.distributed.initialize()" in " ".join(remote_command(c) for c in ssh_calls(calls))


@pytest.mark.parametrize("script,args", [
    ("bench_published.sh", []), ("train_drafter.sh", ["--config", "c.yaml"]), ("run.sh", ["--", "true"])])
def test_single_host_is_not_distributed_unless_asked(env, script, args):
    r = env.run(script, "--dry-run", "--foreground", *args)
    body = " ".join(remote_command(c) for c in ssh_calls(dry_commands(r.stdout)))
    assert "--distributed" not in body and "DFLASH_DISTRIBUTED" not in body
    r = env.run(script, "--dry-run", "--foreground", "--distributed", *args)
    assert "DFLASH_DISTRIBUTED=1" in " ".join(remote_command(c) for c in ssh_calls(dry_commands(r.stdout)))
    r = env.run(script, "--dry-run", "--foreground", "--type", "v5p-16", "--no-distributed", *args)
    assert "DFLASH_DISTRIBUTED" not in " ".join(remote_command(c) for c in ssh_calls(dry_commands(r.stdout)))


def test_multislice_runs_on_every_node(env):
    r = env.run("run.sh", "--num-slices", "3", "--foreground", "--", "hostname")
    assert r.returncode == 0, r.stderr
    nodes = sorted(c[4] for c in ssh_calls(env.tpu_calls()))
    assert nodes == ["dflash-tpu-0", "dflash-tpu-1", "dflash-tpu-2"]
    assert all("--worker=all" in c for c in env.tpu_calls())


# ----------------------------------------------------------------------------- job commands
def _job_argv(call) -> list[str]:
    """argv of the python command inside a foreground job's remote command."""
    cmd = remote_command(call)
    prefix = "cd dflash-jax || exit 1; "
    assert cmd.startswith(prefix), cmd
    body = cmd[len(prefix):]
    body = body.split(" && ", 1)[1] if body.startswith("export ") else body
    return shlex.split(body)


def test_bench_published_commands(env):
    r = env.run("bench_published.sh", "--dry-run", "--foreground", "--max-samples", "12", "--out", "res/pub")
    assert r.returncode == 0, r.stderr
    (call,) = dry_commands(r.stdout)
    assert "--worker=all" in call
    cmd = remote_command(call)
    for d in DATASETS:
        want = (f"~/dflash-venv/bin/python -m infer.benchmark --target Qwen/Qwen3-8B --drafter "
                f"z-lab/Qwen3-8B-DFlash-b16 --dataset {d} --max-samples 12 --out res/pub/{d} --dtype bfloat16 || rc=1")
        assert want in cmd, (want, cmd)
    r = env.run("bench_published.sh", "--dry-run", "--foreground", "--datasets", "gsm8k,mbpp", "--python", "python3",
                "--target", "Qwen/Qwen3-4B", "--drafter", "z-lab/Qwen3-4B-DFlash-b16")
    cmd = remote_command(dry_commands(r.stdout)[0])
    assert cmd.count("-m infer.benchmark") == 2 and "python3 -m infer.benchmark --target Qwen/Qwen3-4B" in cmd


@pytest.mark.parametrize("ckpt", ["/tmp/ckpts/run1", "ckpt/local-run", "gs://bucket/x"])
def test_checkpoint_path_is_passed_unchanged(env, ckpt):
    r = env.run("train_drafter.sh", "--dry-run", "--foreground", "--config", "configs/qwen3_8b_v5p8.yaml",
                "--ckpt-dir", ckpt, "--resume", "--", "optimizer.lr=3e-4", "data.max_length=2048")
    assert r.returncode == 0, r.stderr
    (call,) = dry_commands(r.stdout)
    assert _job_argv(call) == ["~/dflash-venv/bin/python", "-m", "train", "--config", "configs/qwen3_8b_v5p8.yaml",
                               "--resume", f"checkpoint.dir={ckpt}", "optimizer.lr=3e-4", "data.max_length=2048"]
    # background (default) mode: the same words, one quoting level deeper
    r = env.run("train_drafter.sh", "--dry-run", "--config", "configs/qwen3_8b_v5p8.yaml", "--ckpt-dir", ckpt)
    launch = remote_command(dry_commands(r.stdout)[0])
    assert f"-m train --config configs/qwen3_8b_v5p8.yaml checkpoint.dir={ckpt}" in launch and "nohup" in launch


def test_train_bucket_shorthand_and_warnings(env):
    r = env.run("train_drafter.sh", "--dry-run", "--foreground", "--config", "c.yaml", "--bucket", "gs://my-bkt/",
                "--run-name", "r1")
    assert "checkpoint.dir=gs://my-bkt/dflash/r1" in _job_argv(dry_commands(r.stdout)[0])
    r = env.run("train_drafter.sh", "--dry-run", "--config", "c.yaml")
    assert "lost" in r.stderr and "checkpoint.dir=checkpoints/drafter" in r.stdout
    r = env.run("train_drafter.sh", "--dry-run", "--config", "c.yaml", "--type", "v5p-16", "--ckpt-dir", "/x")
    assert "multi-host" in r.stderr and "gs://" in r.stderr


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("script,args,words", [
    ("create.sh", ["--type", "tpu100"], ["accelerator type 'tpu100'"]),
    ("create.sh", ["--type", "v5p-12"], ["multiples of 8"]),
    ("create.sh", ["--type", "v9x-8"], ["no defaults for TPU family 'v9x'"]),
    ("create.sh", ["--bogus"], ["unknown option '--bogus'"]),
    ("create.sh", ["--name", "Bad_Name"], ["TPU name 'Bad_Name'"]),
    ("create.sh", ["--zone"], ["--zone needs a value"]),
    ("create.sh", ["--zone", "nowhere"], ["zone 'nowhere'"]),
    ("create.sh", ["--num-slices", "two"], ["--num-slices must be a whole number"]),
    ("bench_published.sh", ["--max-samples", "0"], ["--max-samples must be at least 1"]),
    ("bench_published.sh", ["--max-samples", "ten"], ["--max-samples must be a whole number"]),
    ("bench_published.sh", ["--detach", "--fetch", "x"], ["--fetch needs the job to be followed"]),
    ("bench_published.sh", ["--dtype", "fp8"], ["--dtype must be bfloat16 or float32"]),
    ("train_drafter.sh", [], ["--config YAML is required"]),
    ("train_drafter.sh", ["--config", "c.yaml", "--", "oops"], ["override 'oops'"]),
    ("train_drafter.sh", ["--config", "c.yaml", "--bucket", "b1x", "--ckpt-dir", "d"], ["not both"]),
    ("run.sh", [], ["no command given"]),
    ("run.sh", ["--worker", "x", "--", "true"], ["--worker 'x'"]),
    ("run.sh", ["--env", "novalue", "--", "true"], ["--env wants KEY=VALUE"]),
    ("setup.sh", ["--data", "/nonexistent/dir"], ["--data '/nonexistent/dir' is not a directory"]),
    ("setup.sh", ["--ref", "v1"], ["--ref needs --git"]),
])
def test_bad_input_is_a_usage_error(env, script, args, words):
    r = env.run(script, "--dry-run", *args)
    assert_usage_error(r, *words)
    assert "+ gcloud" not in r.stdout


# ----------------------------------------------------------------------------- simulated TPU VM
@pytest.fixture
def vm(env, tmp_path):
    """A fake one-worker TPU VM home with the project copied by setup.sh and a fake venv python."""
    home = tmp_path / "vmhome"
    home.mkdir()
    env.base["FAKE_TPU_HOME"] = str(home)
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text('{"question": "1+1?"}\n')
    r = env.run("setup.sh", "--no-install", "--no-check", "--data", str(data))
    assert r.returncode == 0, r.stderr
    py = home / "dflash-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    return home


def _python_calls(home: Path) -> list[list[str]]:
    f = home / "python_calls.tsv"
    return [line.rstrip("\t").split("\t") for line in f.read_text().splitlines()] if f.exists() else []


def test_sim_setup_copies_checkout_and_data(vm):
    proj = vm / "dflash-jax"
    assert (proj / "pyproject.toml").is_file() and (proj / "tpu_scripts" / "common.sh").is_file()
    assert (proj / "tests" / "test_tpu_scripts.py").is_file()
    assert not (proj / ".git").exists()
    assert (vm / "shared" / "data" / "gsm8k" / "test.jsonl").is_file()
    assert not list(vm.glob("*.tar.gz")), "tarballs left on the VM"


def test_sim_background_job_streams_log_and_exit_status(env, vm):
    r = env.run("run.sh", "--log", "t1", "--", "echo line-one; sleep 1; echo line-two")
    assert r.returncode == 0, r.stderr
    assert "line-one" in r.stdout and "line-two" in r.stdout and "finished with status 0" in r.stdout
    assert (vm / "dflash-jax" / "logs" / "t1.log.rc").read_text().strip() == "0"
    r = env.run("run.sh", "--log", "t2", "--", "echo about-to-fail; exit 3")
    assert r.returncode == 6, r.stderr
    assert "about-to-fail" in r.stdout and "finished with status 3" in r.stdout
    # logs.sh reads the same log again, with the job's status
    r = env.run("logs.sh", "--log", "t2")
    assert r.returncode == 6 and "about-to-fail" in r.stdout
    r = env.run("logs.sh", "--log", "t1", "--once")
    assert r.returncode == 0 and "line-two" in r.stdout and "[finished with status 0]" in r.stdout
    # --detach returns at once; quoting of separate words survives both shells
    r = env.run("run.sh", "--detach", "--log", "t3", "--env", "GREETING=hello world", "--",
                "bash", "-c", 'echo "$GREETING" "it'"'"'s" > greeting.txt')
    assert r.returncode == 0, r.stderr
    r = env.run("logs.sh", "--log", "t3")
    assert r.returncode == 0
    assert (vm / "dflash-jax" / "greeting.txt").read_text() == "hello world it's\n"


def test_sim_bench_published_runs_all_datasets_and_fetches(env, vm, tmp_path):
    r = env.run("bench_published.sh", "--max-samples", "3", "--fetch", str(tmp_path / "got"), "--", "--temperature", "0")
    assert r.returncode == 0, r.stderr + r.stdout
    calls = _python_calls(vm)
    assert [c[c.index("--dataset") + 1] for c in calls] == DATASETS
    for c, d in zip(calls, DATASETS):
        assert c == ["-m", "infer.benchmark", "--target", "Qwen/Qwen3-8B", "--drafter", "z-lab/Qwen3-8B-DFlash-b16",
                     "--dataset", d, "--max-samples", "3", "--out", f"results/published/{d}", "--dtype", "bfloat16",
                     "--temperature", "0"]
    for d in DATASETS:
        assert json.loads((tmp_path / "got" / "published" / d / "summary.json").read_text())["tokens_per_second"] > 0


def test_sim_bench_failure_is_reported(env, vm):
    r = env.run("bench_published.sh", "--datasets", "gsm8k,mbpp", env={"FAKE_PY_RC": "1"})
    assert r.returncode == 6
    assert len(_python_calls(vm)) == 2, "a failing data set must not stop the others"


@pytest.mark.parametrize("ckpt", ["ckpt dir/run 1", "gs://bucket/x"])
def test_sim_train_passes_checkpoint_and_resume(env, vm, ckpt):
    r = env.run("train_drafter.sh", "--config", "configs/qwen3_8b_v5p8.yaml", "--ckpt-dir", ckpt, "--resume",
                "--distributed", "--", "train.steps=10")
    assert r.returncode == 0, r.stderr
    (call,) = _python_calls(vm)
    assert call == ["-m", "train", "--config", "configs/qwen3_8b_v5p8.yaml", "--resume", "--distributed",
                    f"checkpoint.dir={ckpt}", "train.steps=10"]
    log = (vm / "dflash-jax" / "logs" / "train.log").read_text()
    assert "fake python" in log
