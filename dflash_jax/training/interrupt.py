"""Ctrl-C in long jobs: finish the unit of work in flight, keep what it produced, say where to resume.

`graceful_stop()` turns the first SIGINT into a flag that the training loop polls after each step (it
then saves a checkpoint of that step and raises `Interrupted`); a second Ctrl-C interrupts at once.
`Interrupted` carries one line for the user; the CLIs print it instead of a traceback.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(Exception):
    """A job stopped on Ctrl-C; str(e) is the one line to show (where it stopped, how to resume)."""


class _Flag:
    requested = False


@contextlib.contextmanager
def graceful_stop():
    """Yields a flag whose `.requested` turns True on the first Ctrl-C (SIGINT); the second raises
    KeyboardInterrupt as usual. Outside the main thread (no signal handlers there) the flag never
    turns True and Ctrl-C behaves as usual."""
    flag = _Flag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if flag.requested:
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        flag.requested = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
