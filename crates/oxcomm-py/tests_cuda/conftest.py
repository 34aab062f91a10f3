"""The CUDA tests: on a GPU machine (``bench/gpu_check.sh``) on CUDA, anywhere else on the fake
device of ``tests/_fake_device.py`` (CI), the same files and nothing skipped.

This file makes ``../tests`` importable (``_torch_ranks``, ``_fake_device``, ``_on_device``), and
gives the ranks' runs a seed: on the fake device every test that starts ranks runs once per seed
of ``OXCOMM_FAKE_SEEDS`` (comma-separated, default ``1,2``), and a failure names the seed
(``OXCOMM_FAKE_SEEDS=<seed> python3 -m pytest crates/oxcomm-py/tests_cuda -k <test>`` replays it);
on CUDA the seed is unused and each test runs once.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
for path in (HERE, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)

import _torch_ranks  # noqa: E402

#: For the ranks that ``_torch_ranks.run`` spawns: both folders importable.
RANKS_ENV = {"PYTHONPATH": os.pathsep.join([HERE, TESTS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

#: On the fake device, the part size of staged ops: small, so that the tests' larger tensors are
#: cut into more parts than there are pinned slots (every slot is reused within an op).
FAKE_ENV = {"OXCOMM_CUDA_CHUNK_BYTES": str(256 << 10)}


def on_cuda():
    import torch

    return torch.cuda.is_available()


def seeds():
    if on_cuda():
        return [None]
    return [int(s) for s in os.environ.get("OXCOMM_FAKE_SEEDS", "1,2").split(",") if s.strip()]


def pytest_report_header(config):
    if on_cuda():
        return "oxcomm CUDA tests: on CUDA"
    return f"oxcomm CUDA tests: on the fake device (no CUDA here), seeds {seeds()}"


def pytest_configure(config):
    config.addinivalue_line("markers", "worlds(*sizes): run on each number of ranks (on the fake device, "
                            "the first size with every seed, the others with the first seed)")
    config.addinivalue_line("markers", "one_seed: on the fake device, run with the first seed only")


def pytest_generate_tests(metafunc):
    """``seed`` (and ``world``, for a test marked ``worlds``): on the fake device every seed for
    the first world size, the first seed for the others and for a test marked ``one_seed``."""
    if "seed" not in metafunc.fixturenames:
        return
    all_seeds = seeds()
    first = all_seeds[:1]
    mark = metafunc.definition.get_closest_marker("worlds")
    one = metafunc.definition.get_closest_marker("one_seed") is not None
    name = lambda s: "cuda" if s is None else f"seed{s}"  # noqa: E731
    if mark is None:
        metafunc.parametrize("seed", first if one else all_seeds, ids=name)
        return
    runs = [(w, s) for k, w in enumerate(mark.args) for s in (all_seeds if k == 0 and not one else first)]
    metafunc.parametrize("world,seed", runs, ids=[f"{w}ranks-{name(s)}" for w, s in runs])


def run(world, target, seed, *, timeout, env=None):
    """``_torch_ranks.run`` with the folders importable and, on the fake device, ``seed``; a
    failure on the fake device says how to replay its seed."""
    e = dict(RANKS_ENV)
    if seed is not None:
        e.update(FAKE_ENV)
        e["OXCOMM_FAKE_SEED"] = str(seed)
    e.update(env or {})
    try:
        return _torch_ranks.run(world, target, timeout=timeout, env=e)
    except _torch_ranks.RanksFailed as err:
        if seed is None:
            raise
        raise _torch_ranks.RanksFailed(
            f"on the fake device with seed {seed} (replay: OXCOMM_FAKE_SEEDS={seed}):\n{err}"
        ) from None
