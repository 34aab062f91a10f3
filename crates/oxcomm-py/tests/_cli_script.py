"""The installed ``oxcomm`` script (the wheel's ``[project.scripts]`` entry) for the tests that
run the command: where it is, and running it with a deadline, its whole process group killed
if the deadline passes (so no rank it started outlives the test)."""

import os
import signal
import subprocess
import sysconfig


def path():
    """The ``oxcomm`` script of this interpreter's environment; fails (not skips) when the
    package is not installed, since CI must not pass without the launcher."""
    script = os.path.join(sysconfig.get_path("scripts"), "oxcomm")
    if not os.path.exists(script):
        raise AssertionError(f"no oxcomm script at {script}: install the package (pip install ./crates/oxcomm-py)")
    with open(script, "rb") as f:
        head = f.read(128)
    # A cargo-built binary of the same name would not be the wheel's entry point.
    assert head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0], f"{script} is not a Python script"
    return script


def start(args, **kw):
    """``oxcomm *args`` in its own session (a process group the test can signal and kill)."""
    return subprocess.Popen(
        [path(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        **kw,
    )


def finish(proc, timeout):
    """Waits for ``proc`` up to ``timeout`` seconds; on the deadline kills its process group
    and raises. Returns a ``subprocess.CompletedProcess``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"oxcomm {proc.args[1:]} still ran after {timeout} s\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(args, timeout, **kw):
    """``oxcomm *args`` to completion (see :func:`finish`)."""
    return finish(start(args, **kw), timeout)


__all__ = ["path", "start", "finish", "run"]
