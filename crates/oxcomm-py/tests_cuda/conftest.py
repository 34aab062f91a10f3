"""The CUDA-only tests: run by ``bench/gpu_check.sh`` on a GPU machine, never by CI.

CI has no GPU and must skip nothing, so it does not collect this folder; each test here has a CPU
twin in ``../tests`` that CI runs (the same code with CPU tensors, or with a fake device that defers
its copies). This file makes ``../tests`` importable (``_torch_ranks`` and its workers) and skips the
whole folder, saying why, where CUDA is not available.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

#: For the ranks that ``_torch_ranks.run`` spawns: both folders importable.
RANKS_ENV = {"PYTHONPATH": os.pathsep.join([HERE, TESTS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA is not available (these tests run on a GPU machine: bench/gpu_check.sh)")
    for item in items:
        item.add_marker(skip)
