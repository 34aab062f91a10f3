"""oxcomm.optim's 1-bit Adam, 1-bit LAMB and 0/1 Adam on CPU ranks: against their exact
counterparts, under DDP, as DeepSpeed's client optimizer, resumed from a state dict, and on the
parameters DeepSpeed's versions turned into NaN. The ranks run ``_optim_ranks``'s cases; the
CUDA runs of the same cases are ``tests_cuda/test_cuda_optimizers.py``.
"""

from __future__ import annotations

import pytest

import _torch_ranks

NAMES = ("onebit_adam", "onebit_lamb", "zero_one_adam")


def test_plain_loop_within_2_percent_of_exact_and_ranks_agree():
    """1-bit Adam and 0/1 Adam against DDP + torch.optim.Adam, 1-bit LAMB against exact LAMB
    (the same optimizer, never frozen), on the example's GELU MLP (200 steps, LAMB 400) from one
    seed: held-out loss within 2%, and every rank holds the same parameters, bit for bit."""
    res = _torch_ranks.run(2, "_optim_ranks:case_plain_loop", timeout=120)
    for name, r in res[0].items():
        assert r["params"] == res[1][name]["params"], name
    losses = {k: v["loss"] for k, v in res[0].items()}
    assert losses["onebit_adam"] <= losses["adam"] * 1.02, losses
    assert losses["zero_one_adam"] <= losses["adam"] * 1.02, losses
    assert losses["onebit_lamb"] <= losses["exact_lamb"] * 1.02, losses


def test_ddp_hook_averages_exactly_the_exact_steps():
    res = _torch_ranks.run(2, "_optim_ranks:case_ddp", timeout=120)
    for rank in res:
        for name in NAMES:
            assert rank[name]["same"] and rank[name]["communicator_same"], (name, rank[name])
    steps = {name: res[0][name]["averaged_steps"] for name in NAMES}
    # warm-up of 8 steps (a fifth of 40): the hook averages steps 1..8 and never again
    assert steps["onebit_adam"] == list(range(1, 9)), steps
    assert steps["onebit_lamb"] == list(range(1, 9)), steps
    # 0/1 Adam: every step up to the 4th variance step (step 5), then every 2nd up to the 8th
    # (step 12), then every 4th; none after var_freeze_step + 1 = 21
    assert steps["zero_one_adam"] == [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20], steps


def test_deepspeed_client_optimizer_matches_plain_loop():
    pytest.importorskip("deepspeed")
    res = _torch_ranks.run(2, "_optim_ranks:case_deepspeed", timeout=900)
    for rank in res:
        for name in NAMES:
            r = rank[name]
            assert r["same"], (name, r)
            # the engine averages before step 1 by default, and from then on exactly as told
            assert r["engine_on"] == r["exact"], (name, r)


def test_state_dict_resumes_bit_for_bit():
    res = _torch_ranks.run(2, "_optim_ranks:case_resume", timeout=120)
    for rank in res:
        for key, r in rank.items():
            assert r["same"] and r["state"], (key, r)
    # the local-phase save of 0/1 Adam falls between two sync steps (28 and 32: interval 4)
    assert res[0]["zero_one_adam@31"]["mid"] == [31, 4], res[0]["zero_one_adam@31"]


def test_empty_zero_gradient_and_zero_lr_parameters_stay_finite():
    res = _torch_ranks.run(2, "_optim_ranks:case_degenerate", timeout=120)
    for rank_id, rank in enumerate(res):
        for name in NAMES:
            r = rank[name]
            assert r["frozen"] and r["finite"] and r["zero_stays_zero"] and r["lr0_still"], (name, r)
            assert r["float64"] and f"rank {rank_id}:" in r["float64"] and "float32" in r["float64"], r


def test_device_twin_on_cpu_is_exact():
    """The CPU twin of tests_cuda's CUDA-against-CPU check: the same harness with both runs on
    CPU gives identical results."""
    res = _torch_ranks.run(2, "_optim_ranks:case_device_vs_cpu", timeout=120, env={"OXCOMM_TEST_DEVICE": "cpu"})
    for rank in res:
        for name in NAMES:
            r = rank[name]
            assert r["param_rel"] == 0.0 and r["loss_rel"] == 0.0 and r["finite"], (name, r)
