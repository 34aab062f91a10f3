"""What the rank programs of ``test_stacks.py`` and ``test_deepspeed_inference.py`` share:
the rank's stderr read back (to assert a clean run prints no ``[c10d]`` warning), the
backend under test, and parameters as JSON (exact floats) for pytest to compare.

Processes are started by ``_torch_ranks.run``; this module runs inside the ranks only.
"""

from __future__ import annotations

import os
import sys
import tempfile


def backend():
    """The backend this job runs on (``STACKS_BACKEND``: ``oxcomm`` or ``gloo``)."""
    return os.environ.get("STACKS_BACKEND", "oxcomm")


class Stderr:
    """Everything written to file descriptor 2 inside the ``with`` (Python's and c10d's C++
    log lines alike), kept in a temporary file and written back to the real stderr at the end,
    so that a failing rank's output still shows it. ``c10d`` holds the lines that c10d logged."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 2)
        self.c10d = []
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        text = self._file.read().decode(errors="replace")
        self._file.close()
        os.write(2, text.encode())
        self.c10d = [line for line in text.splitlines() if "[c10d]" in line]
        return False


def params(module):
    """{name: flat list of floats} of a module's parameters (full tensors)."""
    return {name: p.detach().float().reshape(-1).tolist() for name, p in module.named_parameters()}
