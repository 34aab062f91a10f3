"""``bench/gpu_check.sh`` cannot pass by accident (issue 37, defect 6): run here, on a machine
without CUDA, it must exit non-zero and say why; with every CUDA test skipped it must exit
non-zero and list every test in its per-test file; at a step's deadline it must kill every
process the step started, the test ranks too (they run in sessions of their own).

The script's switches for checking its own logic are used here (``GPU_CHECK_USE_INSTALLED``: the
oxcomm this Python imports, not a wheel; ``GPU_CHECK_WITHOUT_CUDA``: run the steps anyway, on the
fake device; ``GPU_CHECK_STEPS``: only some steps); none of them can make the check pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.sh")
TESTS_CUDA = os.path.join(ROOT, "crates", "oxcomm-py", "tests_cuda")


def _check(tmp_path, env, timeout=240):
    """Run the script (its output folder under ``tmp_path``): (exit status, log, its pid)."""
    out = tmp_path / "out"
    e = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_USE_INSTALLED="1", **env)
    p = subprocess.Popen(["bash", SCRIPT], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    log = (out / "gpu_check.log").read_text()
    assert stdout.strip().splitlines()[-1] == log.strip().splitlines()[-1], "the log lost the closing line"
    return p.returncode, log, p.pid


def _step_processes(pid):
    """Pids of live processes that carry a step token of the script whose pid is ``pid``."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if f"OXCOMM_GPU_CHECK_STEP=gpu-check-{pid}-".encode() in env:
            found.append(int(d))
    return found


def test_without_cuda_it_fails_and_says_why(tmp_path):
    rc, log, _ = _check(tmp_path, {})
    assert rc != 0
    assert "missing: CUDA" in log and "nothing was run" in log, log


def test_with_every_cuda_test_skipped_it_fails_and_lists_every_test(tmp_path):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "_skip_all.py").write_text(
        "import pytest\n\n\ndef pytest_collection_modifyitems(config, items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.skip(reason='forced by test_gpu_check'))\n"
    )
    env = {
        "GPU_CHECK_WITHOUT_CUDA": "1",
        "GPU_CHECK_STEPS": "1",
        "PYTEST_ADDOPTS": "-p _skip_all",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")])),
    }
    rc, log, _ = _check(tmp_path, env)
    assert rc != 0, log
    lines = (tmp_path / "out" / "tests.txt").read_text().splitlines()
    names = set()
    for f in sorted(os.listdir(TESTS_CUDA)):
        if f.startswith("test_") and f.endswith(".py"):
            names |= set(re.findall(r"^def (test_\w+)", open(os.path.join(TESTS_CUDA, f)).read(), re.M))
    listed = {re.sub(r"\[.*", "", ln.split("::")[-1].split(":")[0]) for ln in lines}
    assert names and names <= listed, f"not listed: {sorted(names - listed)}"
    assert all(ln.startswith("SKIPPED (not allowed)") for ln in lines), lines[:5]
    assert "FAIL: the CUDA tests" in log and "no GPU ran this check" in log, log[-2000:]


def test_a_step_past_its_deadline_leaves_no_rank_behind(tmp_path):
    env = {
        "GPU_CHECK_WITHOUT_CUDA": "1",
        "GPU_CHECK_STEPS": "1",
        "TESTS_TIMEOUT": "25",
        "PYTEST_ADDOPTS": "-k test_torch_ops_on_the_device",  # starts ranks and runs for minutes
    }
    t0 = time.monotonic()
    rc, log, pid = _check(tmp_path, env)
    assert rc != 0 and "(deadline: ended after 25s)" in log, log[-2000:]
    assert time.monotonic() - t0 < 120
    assert _step_processes(pid) == [], "processes of the step outlived it"
    assert "did not finish" in (tmp_path / "out" / "tests.txt").read_text()
