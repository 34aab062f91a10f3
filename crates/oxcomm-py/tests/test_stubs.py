"""The type stubs of the native module (``oxcomm/_native.pyi``) and ``py.typed``: mypy's
``stubtest`` compares every class, function and method of the built ``oxcomm._native``
with the stub (names, parameters, defaults, properties), and mypy type-checks a small program
against the package, which must be clean but for the one type error put in it. Needs mypy
(CI installs it); without it these tests are skipped."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

import oxcomm  # noqa: E402

_PACKAGE = os.path.dirname(os.path.abspath(oxcomm.__file__))

_PROGRAM = """
import oxcomm
from oxcomm import _native

def step(comm: _native.Communicator, x: bytearray) -> int:
    buf = (0, len(x) // 4, "f32", x)
    work = comm.all_reduce(buf, "sum", True)
    if work is not None:
        work.wait(timeout=10.0)
    parts: list[bytes] = comm.all_gather_bytes(b"hi")
    state = _native.OneBitState(16, comm.size)
    _native.onebit_all_reduce(comm, buf, state)
    return comm.rank + len(parts) + state.padded_len

token: str = _native.generate_token()
status: int = _native.cli_main(["oxcomm", "--version"], ["oxcomm"])
"""


def _mypy(tmp_path, source):
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(source))
    cmd = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--follow-imports=silent", str(prog)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_package_is_marked_typed():
    assert os.path.exists(os.path.join(_PACKAGE, "py.typed"))
    assert os.path.exists(os.path.join(_PACKAGE, "_native.pyi"))


def test_stubtest_finds_the_stub_equal_to_the_module(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "oxcomm._native"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"


def test_a_program_type_checks_and_its_one_type_error_is_reported(tmp_path):
    # One mypy run (they are slow): the program is clean but for the last line's error.
    res = _mypy(tmp_path, _PROGRAM + "\nwrong: int = _native.generate_token()\n")
    errors = [line for line in res.stdout.splitlines() if ": error: " in line]
    assert res.returncode == 1 and len(errors) == 1, res.stdout + res.stderr
    assert 'Incompatible types in assignment (expression has type "str", variable has type "int")' in errors[0], res.stdout
