"""The ``oxcomm`` command the package installs (``[project.scripts]``, ``oxcomm._cli``) and
``python -m oxcomm``: the version, ``check`` and ``bench`` (which start their ranks again
through ``python -m oxcomm``), ``launch`` of Python ranks that join with ``oxcomm.init()``,
and Ctrl-C / SIGTERM sent to the launcher reaching every rank. Each run has a deadline and its
process group is killed when it passes (``_cli_script``)."""

import os
import signal
import subprocess
import sys
import time

import pytest

import _cli_script


def test_version():
    res = _cli_script.run(["--version"], timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("oxcomm "), res.stdout


def test_python_dash_m_runs_the_same_command():
    res = subprocess.run([sys.executable, "-m", "oxcomm", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("oxcomm "), res.stdout


def test_a_bad_command_line_is_one_line_and_status_2():
    res = _cli_script.run(["bench", "--no-such-flag"], timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("oxcomm: error: ") and res.stderr.count("\n") == 1, res.stderr


def test_check_on_threads_and_shm():
    # shm jobs re-run the command as ranks ([python, -m, oxcomm, ...] from the script).
    res = _cli_script.run(["check", "--transport", "threads,shm", "--world-size", "2", "--op", "all_reduce"], timeout=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "shm/2" in res.stdout and "all passed: OK" in res.stdout, res.stdout


def test_bench_over_shared_memory():
    res = _cli_script.run(["bench", "-b", "8", "-e", "1K", "-n", "5", "--world-size", "2"], timeout=240)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert "transport: shm" in res.stdout, res.stdout
    assert "# Out of bounds values : 0 OK" in res.stdout, res.stdout


def test_launch_python_ranks():
    prog = (
        "import numpy as np, oxcomm; c = oxcomm.init(); x = np.full(4, c.rank + 1, np.int64); "
        "c.all_reduce(x); print('sum', c.rank, c.size, int(x[0]), flush=True)"
    )
    res = _cli_script.run(["launch", "-n", "2", "--", sys.executable, "-c", prog], timeout=180)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    for r in range(2):
        assert f"sum {r} 2 3" in res.stdout, res.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_to_the_launcher_reach_every_rank(tmp_path, sig):
    # Each rank writes ready.<rank>, then waits; its handler writes got.<rank> and exits 0.
    prog = (
        "import os, signal, sys, time\n"
        "d, r = sys.argv[1], os.environ['RANK']\n"
        "def on(s, f):\n"
        "    open(os.path.join(d, 'got.' + r), 'w').write('got')\n"
        "    sys.exit(0)\n"
        f"signal.signal({int(sig)}, on)\n"
        "open(os.path.join(d, 'ready.' + r), 'w').close()\n"
        "time.sleep(120)\n"
    )
    proc = _cli_script.start(["launch", "-n", "2", "--", sys.executable, "-c", prog, str(tmp_path)])
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
        if proc.poll() is not None or time.monotonic() > deadline:
            _cli_script.finish(proc, timeout=30)
            pytest.fail(f"the ranks did not start within 120 s (launcher status {proc.returncode})")
        time.sleep(0.05)
    start = time.monotonic()
    os.kill(proc.pid, sig)
    res = _cli_script.finish(proc, timeout=60)
    assert res.returncode == 128 + sig, f"{res.returncode}\n{res.stderr}"
    assert time.monotonic() - start < 30
    for r in range(2):
        assert (tmp_path / f"got.{r}").read_text() == "got", f"rank {r} did not get {sig!r}"
