"""The ``oxcomm`` command (launch, bench, check) from the Python package: the ``oxcomm``
script the wheel installs and ``python -m oxcomm`` both call :func:`main`.

The command is the Rust one (``oxcomm-cli``), run in this process through
``_native.cli_main`` with the GIL released. When it starts itself again (the ranks of
``bench`` and ``check``) it runs ``[sys.executable, "-m", "oxcomm", ...]``, so no separate
executable is needed. Signals behave as for the native executable: Python's SIGINT handler is
put back to the default before the command starts, so Ctrl-C ends the command (``launch``
installs its own handlers and forwards it to the ranks) instead of raising
``KeyboardInterrupt`` after the command returns.
"""

import signal
import sys

from . import _native


def main(argv=None):
    """Runs ``oxcomm`` with ``argv`` (default ``sys.argv``; item 0 is the program name) and
    exits with its status."""
    if argv is None:
        argv = sys.argv
    # As a native executable starts: SIGINT ends the process until a command installs its own
    # handler. Python's handler would only set a flag nobody reads while the command runs.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    code = _native.cli_main(["oxcomm", *argv[1:]], [sys.executable, "-m", "oxcomm"])
    sys.exit(code)
