"""The tracked tree speaks of the project only: no line names a work round (a numbered session, a lettered run
or sweep, a round-named folder such as `auto_cpu_s12`), and the README is short user documentation that starts
with the two commands CI runs."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each pattern names a work round. Case-sensitive where a capital letter is the round's name.
ROUND_PATTERNS = [
    re.compile(r"\bsessions?\s+\d+", re.IGNORECASE),                 # "session N", "Session N's", "sessions N-M"
    re.compile(r"\bsession\s+(?:of|after|before)\b"),                 # "the session after ..."
    re.compile(r"(?<![A-Za-z0-9])s(?!8\b|16\b|32\b|64\b)[0-9]{2}(?![0-9])"),  # a round number after "s" in a name or path
    re.compile(r"\b[Rr]uns?\s+[A-Z](?:\s+and\s+[A-Z])?\b(?![./'’=]?[A-Za-z0-9])"),  # a lettered run
    re.compile(r"\b[Ss]weeps?\s+[A-Z]\b(?![./'’=]?[A-Za-z0-9])"),   # a lettered sweep
    re.compile(r"\b(?:work|numbered)\s+rounds?\b", re.IGNORECASE),
    re.compile(r"\bround\s+\d+\b(?!\s*(?:of|/))", re.IGNORECASE),    # "round 3" (not "round 1 of 3")
    re.compile(r"\bon days when\b", re.IGNORECASE),
]

# Lines that match a pattern without naming a round.
ALLOWED = [
    re.compile(r"\bssh\b.*\bsession\b|\bsession\b.*\bssh\b", re.IGNORECASE),
]

SKIP_SUFFIXES = (".png", ".jpg", ".gz", ".safetensors", ".npy", ".npz", ".pdf", ".ico")


def round_hits(line: str) -> list[str]:
    if any(a.search(line) for a in ALLOWED):
        return []
    return [m.group(0) for p in ROUND_PATTERNS for m in p.finditer(line)]


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        names = sorted({n for n in out.split("\0") if n})
    except (OSError, subprocess.CalledProcessError):
        names = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("__pycache__", "runs")
                           and not d.endswith(".egg-info")]
            names += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
    return [ROOT / n for n in names if (ROOT / n).is_file() and not n.endswith(SKIP_SUFFIXES)]


@pytest.mark.parametrize("line", [
    "measured in session 1",
    "Session 2 did it",
    "sessions 3-4 did it",
    "(run X, session 5)",
    "runs X and Y",
    "s99 costs",
    "see folder_s99/",
    "results_s42",
    "wrote /tmp/s42/out.json",
    "sweep X",
    "on days when it ran faster",
    "work round 7",
])
def test_the_patterns_catch_lines_that_name_a_round(line):
    assert round_hits(line), line


@pytest.mark.parametrize("line", [
    "--foreground runs it over a plain ssh session instead.",
    '@pytest.fixture(scope="session")',
    "def pytest_collection_modifyitems(session, config, items):",
    '_SHAPE_BYTES = {"s8": 1, "s16": 2, "s32": 4, "s64": 8}',
    "data.output_dir may be a gs:// or s3:// URL",
    "# tpu_ssh WORKER COMMAND: run a shell command string on WORKER",
    "Run a command on every worker of the TPU VM",
    "speedup per round: 1.371x, 1.198x, 1.278x (round 1 of 3)",
    "| 1 | 0.995 (1.26x) | sweep_1.md |",
])
def test_the_patterns_leave_ordinary_lines_alone(line):
    assert not round_hits(line), (line, round_hits(line))


def test_no_tracked_line_names_a_work_round():
    me = Path(__file__).resolve()
    hits = []
    for path in tracked_files():
        if path.resolve() == me:  # this file quotes the patterns' examples
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(ROOT).as_posix()
        for no, line in enumerate(text.splitlines(), 1):
            found = round_hits(line)
            if found:
                hits.append(f"{rel}:{no}: {found}: {line.strip()[:160]}")
    assert not hits, f"{len(hits)} tracked line(s) name a work round:\n" + "\n".join(hits)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    start = next(i for i, line in enumerate(lines) if line.strip() == "```bash")
    assert lines[start + 1:start + 3] == [
        "pip install -e . && python -m infer.generate",
        'pip install -e ".[test]" && python -m pytest -q',
    ]
