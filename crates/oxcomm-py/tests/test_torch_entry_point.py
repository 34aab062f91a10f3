"""``init_process_group("oxcomm")`` with no oxcomm import: the installed package registers the
backend in torch's ``torch.distributed.backends`` entry-point group (``pyproject.toml``,
``oxcomm/_entry_points.py``), which torch reads the first time a group names the backend.

These tests run fresh interpreters: what they check is what a script that only names the
backend as a string (Lightning's ``process_group_backend``, DeepSpeed's ``dist_backend``) sees.
In CI the package is the wheel ``test.sh`` installs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import _torch_ranks

pytest.importorskip("torch")


def _fresh(code, env=None):
    """Run ``code`` in a new interpreter outside this directory (nothing of the tests on its path)."""
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=e, capture_output=True, text=True, timeout=120
    )


def test_the_installed_package_declares_the_entry_point():
    out = _fresh(
        "from importlib.metadata import entry_points\n"
        "eps = [e for e in entry_points(group='torch.distributed.backends') if e.name == 'oxcomm']\n"
        "print(eps[0].value if eps else 'none')\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "oxcomm._entry_points:register_torch_backend", out.stdout


def test_init_process_group_oxcomm_without_importing_oxcomm():
    out = _fresh(
        "import sys, torch, torch.distributed as dist\n"
        "assert 'oxcomm' not in sys.modules, 'oxcomm imported before the group'\n"
        "dist.init_process_group('oxcomm', store=dist.HashStore(), rank=0, world_size=1)\n"
        "t = torch.ones(3); dist.all_reduce(t)\n"
        "print(dist.get_backend(), type(dist.group.WORLD).__name__, t.tolist())\n"
        "dist.destroy_process_group()\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["oxcomm", "ProcessGroupOxcomm", "[1.0,", "1.0,", "1.0]"], out.stdout


def case_two_ranks_by_name():
    """In each rank: the world group on "oxcomm" named only as a string; an all-reduce on it."""
    import torch
    import torch.distributed as dist

    assert "oxcomm" not in sys.modules and "oxcomm.torch" not in sys.modules
    dist.init_process_group("oxcomm")
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return [dist.get_backend(), t.tolist()]


def test_two_ranks_with_the_backend_named_as_a_string():
    res = _torch_ranks.run(2, "test_torch_entry_point:case_two_ranks_by_name", timeout=120)
    assert res == [["oxcomm", [3.0] * 4]] * 2, res


def test_a_backend_that_cannot_load_says_so():
    out = _fresh(
        "import sys; sys.modules['oxcomm.torch'] = None  # importing oxcomm.torch fails\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('oxcomm', store=dist.HashStore(), rank=0, world_size=1)\n"
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: oxcomm: the torch.distributed backend 'oxcomm' could not load"), out.stderr
    assert "import oxcomm.torch" in last, last
