"""The installed ``oxcomm`` script (the wheel's ``[project.scripts]`` entry) for the tests that
run the command: where it is, and running it with a deadline, its process group killed if the
deadline passes (the ranks of a ``launch``, each in its own group, then get SIGTERM from the
launcher's death signal)."""

import os
import shutil
import signal
import subprocess
import sys
import sysconfig


def path():
    """The ``oxcomm`` script of this interpreter's environment (its scripts folder, else the
    folder of ``sys.executable``, else the PATH); fails (not skips) when there is none, since
    CI must not pass without the launcher."""
    candidates = [
        os.path.join(sysconfig.get_path("scripts"), "oxcomm"),
        os.path.join(os.path.dirname(sys.executable), "oxcomm"),
        shutil.which("oxcomm"),
    ]
    for script in filter(None, candidates):
        if os.path.isfile(script) and _is_python_script(script):
            return script
    raise AssertionError(f"no oxcomm script among {candidates}: install the package (pip install ./crates/oxcomm-py)")


def _is_python_script(script):
    """Whether ``script`` is a pip-made entry point (a cargo-built binary of the same name, or
    pyenv's shell shim, is not the wheel's script)."""
    with open(script, "rb") as f:
        first = f.readline(512)
    return first.startswith(b"#!") and b"python" in first


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
