"""tests/crash_rerun.py (the suite's xdist plugin): a test whose worker crashed is run again once in a fresh worker
and reported as a rerun; a test that crashes every time and an ordinary failure still fail."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CRASHES = """
import os, signal

def test_before():
    pass

def test_crashes(tmp_path_factory):
    flag = os.path.join({flag!r}, "crashed")
    if {always} or not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)

def test_after():
    pass
"""


def run_suite(tmp_path, always: bool, extra: str = ""):
    (tmp_path / "test_crash.py").write_text(CRASHES.format(flag=str(tmp_path), always=always) + extra)
    (tmp_path / "test_other.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--max-worker-restart", "3",
           "-p", "tests.crash_rerun", "-p", "no:cacheprovider", str(tmp_path)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout.strip().splitlines()[-1]


def test_a_crash_is_run_again_in_a_fresh_worker(tmp_path):
    rc, last = run_suite(tmp_path, always=False)
    assert rc == 0 and "5 passed" in last and "1 rerun" in last, last


def test_a_test_that_always_crashes_and_a_failure_still_fail(tmp_path):
    rc, last = run_suite(tmp_path, always=True, extra="\ndef test_fails():\n    assert False\n")
    assert rc == 1 and "1 rerun" in last and "failed" in last, last
