"""What every command line (`python -m infer.*`, `python -m train*`) shares: JAX on the platforms this machine has,
one line and exit status 130 on Ctrl-C, and the one-line error exit.

    if __name__ == "__main__":
        sys.exit(run(main))                       # or run(main, resume="...") where a rerun continues
"""
from __future__ import annotations

import glob
import importlib.util
import os
import signal
import sys

INTERRUPTED = 130  # the shell's status of a command stopped by SIGINT (128 + 2)

_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")  # libtpu's own: whoever sets them means a TPU


def tpu_present() -> bool:
    """Whether this machine looks like a TPU VM: TPU device files (/dev/accel* on v2-v5p, /dev/vfio/N on v5e and
    later) or libtpu's TPU variables in the environment."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or any(os.environ.get(v) for v in _TPU_ENV))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cpu_unless_accelerator() -> str | None:
    """With libtpu installed (`pip install "dflash-jax[plan]"` or `[test]`) on a machine without a TPU, JAX tries
    the TPU first and libtpu logs `E0000 ... TPU_WORKER_HOSTNAMES` / "Failed to find host bounds" lines before it
    falls back to the CPU. Then run on the CPU directly (JAX_PLATFORMS=cpu): the same devices, no TPU probe.

    Left alone: JAX_PLATFORMS already set, no libtpu, a TPU machine, or a GPU plugin installed (JAX picks the GPU).
    The planner is unaffected: it compiles for TPU topologies through libtpu under JAX_PLATFORMS=cpu too.
    Returns the platforms set, or None. Call it before JAX starts a backend (importing jax is fine)."""
    if os.environ.get("JAX_PLATFORMS") or not _installed("libtpu") or tpu_present():
        return None
    if any(_installed(m) for m in _GPU_PLUGINS):
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"  # subprocesses too
    jax = sys.modules.get("jax")
    if jax is not None and not jax.config.jax_platforms:  # jax read the variable at import: tell it directly
        jax.config.update("jax_platforms", "cpu")
    return "cpu"


def interrupted(resume: str | None = None) -> int:
    """The line a command prints on Ctrl-C (stderr), and its exit status. `resume`: how to continue, if it can."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C stops the exit at once, silently
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print("interrupted" + (f"; {resume}" if resume else ""), file=sys.stderr, flush=True)
    return INTERRUPTED


def exit_now(status: int) -> None:
    """Exit at once with `status` after the atexit handlers (temporary directories, logging), without the rest of
    the interpreter's teardown: a Ctrl-C can land while XLA compiles or runs on its own threads, and tearing the
    runtime down under them crashes (SIGSEGV) instead of exiting."""
    import atexit
    try:
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


def run(main, argv=None, *, resume: str | None = None) -> int:
    """`main(argv)` as a command line: JAX on the platforms present (cpu_unless_accelerator), and on Ctrl-C one line
    ("interrupted", then `resume` when given) and exit status 130 instead of a traceback. Returns main's status."""
    cpu_unless_accelerator()
    try:
        return main(argv)
    except KeyboardInterrupt:
        exit_now(interrupted(resume))


def main_error(msg: str) -> None:
    """A command line's one-line error: `error: msg` on stderr, exit status 2 (argparse's)."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
