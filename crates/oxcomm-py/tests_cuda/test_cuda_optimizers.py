"""oxcomm.optim's 1-bit Adam, 1-bit LAMB and 0/1 Adam on device parameters (CUDA, 2 ranks sharing
``cuda:0``; elsewhere the fake device): the cases of ``tests/_optim_ranks.py`` (whose CPU runs are
``tests/test_optimizers.py``) with ``OXCOMM_TEST_DEVICE=target`` (``_on_device.target()``).

Tolerances. ``case_device_vs_cpu`` feeds both runs the same gradients (computed on CPU), so only
the optimizers' arithmetic differs. Elementwise kernels (add, mul, div, sqrt) round the same on
both devices; reductions (LAMB's norms, the 1-bit all-reduce's scales) sum in another order, a
relative difference of about 1e-7 per step. That changes a 1-bit sign only for an element within
that distance of zero (rare: an expected ~0.04 flips in the 40 steps × ~7,000 elements here); one
flip moves one element by about 2·lr (6e-3), 1.3e-3 of a 64×64 layer's norm. So a parameter
tensor may differ by 5e-3 of its norm and the held-out loss by 1e-3; a real error (a missed or
doubled average, an error buffer on the wrong device or reset) is of order 1.
"""

from __future__ import annotations

import pytest
from conftest import on_cuda, run

NAMES = ("onebit_adam", "onebit_lamb", "zero_one_adam")
#: On the fake device the plain loop is a tenth as long (at least 40 steps:
#: every phase of each optimizer is still crossed); how close the losses come to the exact
#: optimizers' is the optimizers' math, checked at full length on CPU (tests/test_optimizers.py)
#: and on CUDA here.
ENV = {"OXCOMM_TEST_DEVICE": "target", **({} if on_cuda() else {"OXCOMM_TEST_STEPS_DIVISOR": "10"})}


@pytest.mark.one_seed
def test_device_optimizers_match_cpu(seed):
    res = run(2, "_optim_ranks:case_device_vs_cpu", seed, timeout=300, env=ENV)
    for rank in res:
        for name in NAMES:
            r = rank[name]
            assert r["on_device"], (name, r)
            assert r["finite"] and r["param_rel"] <= 5e-3 and r["loss_rel"] <= 1e-3, (name, r)


@pytest.mark.one_seed
def test_device_plain_loop_within_2_percent_of_exact_and_ranks_agree(seed):
    res = run(2, "_optim_ranks:case_plain_loop", seed, timeout=300, env=ENV)
    for name, r in res[0].items():
        assert r["params"] == res[1][name]["params"], name
    losses = {k: v["loss"] for k, v in res[0].items()}
    assert all(0 < v < float("inf") for v in losses.values()), losses
    if not on_cuda():
        return  # a tenth of the run: see ENV
    assert losses["onebit_adam"] <= losses["adam"] * 1.02, losses
    assert losses["zero_one_adam"] <= losses["adam"] * 1.02, losses
    assert losses["onebit_lamb"] <= losses["exact_lamb"] * 1.02, losses


@pytest.mark.one_seed
def test_device_ddp_hook_matches_plain_loop(seed):
    res = run(2, "_optim_ranks:case_ddp", seed, timeout=300, env=ENV)
    for rank in res:
        for name in NAMES:
            assert rank[name]["same"], (name, rank[name])
