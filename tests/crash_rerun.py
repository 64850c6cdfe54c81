"""A pytest plugin for the suite under xdist: a test whose worker process crashed runs once more in a fresh worker.

XLA:CPU (jax 0.10.2) has crashed an xdist worker with a segmentation fault inside a compile about once per full suite
run on the 2-core machine, in a different test each time (none of them crashed when run again alone). xdist's
file-grouped scheduling already sends the crashed test and the rest of its file to the replacement worker; this
plugin reports the first crash of a test as a rerun ("R", counted in the summary line) instead of a failure, so that
the test's verdict is its run in the fresh worker. A second crash of the same test fails it, as does any ordinary
failure: nothing else is retried."""
from __future__ import annotations

import collections

import pytest

_crashes: collections.Counter = collections.Counter()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    _crashes[crashitem] += 1
    if _crashes[crashitem] == 1:
        report.outcome = "rerun"
        report.longrepr = f"{report.longrepr}; run again in a fresh worker"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None
