"""The 1-bit compressed all-reduce on device tensors against the same call on host tensors.

CPU twins: ``tests/test_onebit_torch.py`` (the same kernels and transports on CPU tensors,
against the Rust path, and the Triton kernels in Triton's interpreter). Here, on the device
(CUDA, with 2 and 3 ranks sharing ``cuda:0``; elsewhere the fake device):

* the kernels alone, device against CPU on the same inputs: sign bytes and rows equal, bit for
  bit (the sums of squares may differ in their last float64 bits: see
  ``oxcomm._onebit_kernels``); on CUDA each kernel runs as Triton's, asked for by name, so a
  Triton kernel that fails is an error here, never a silent fallback to the torch ops;
* whole calls over the oxcomm transport (staged through pinned buffers), a gloo group, the
  device's own transport (an nccl group on CUDA; on the fake device, bytes through
  ``torch.distributed`` on an oxcomm group), and ``CompressedBackend``, against the Rust path on
  host tensors: the signs of the output (the servers' sign bits) equal, values and both errors
  within 1e-6 relative;
* the stream contract: a call on a side stream whose input is still being written by earlier
  work on that stream reads the finished input, and later work on that stream sees the
  result, with no synchronisation by the caller; the pinned buffers are reused.

NCCL refuses two ranks on one GPU ("duplicate GPU"): on a one-GPU machine that case is skipped
with NCCL's reason (``bench/gpu_check.sh`` allows that one skip), and the nccl transport is
checked on a one-rank group instead (the same code path).
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import on_cuda, run

import _torch_ranks
from _on_device import target

torch = pytest.importorskip("torch")

from oxcomm import _onebit_kernels as kernels  # noqa: E402
from oxcomm.onebit_torch import padded_len  # noqa: E402

#: The unpack methods a device offers (Triton's only on CUDA: the fake device runs torch ops).
METHODS = ("triton", "select", "flip") if on_cuda() else ("select", "flip")


def _bits(t):
    return t.contiguous().view(torch.int32)


def _max_rel(a, b):
    a, b = a.cpu(), b.cpu()
    return (a - b).abs().max().item() / max(1e-30, b.abs().max().item()) if b.numel() else 0.0


# ------------------------------------------------------------------------------ kernels


def case_kernels():
    """The kernels on the device against the CPU, bit for bit; on CUDA, each Triton kernel by
    name (a failure raises) and the report of which kernels compiled."""
    tg = target()
    gen = torch.Generator().manual_seed(4)
    checked = []
    for numel in (64, 8 * 1001, 3 * 2**20):
        with tg.reference():
            v = torch.randn(3, numel, generator=gen)
            v[:, 1::7] = 0.0
            v[:, 2::7] = -0.0
            v[0, 5] = float("nan")
            want_signs = kernels.pack_signs(v)
        dv = tg.tensor(v)
        got = kernels.pack_signs(dv)  # Triton's on CUDA
        assert torch.equal(tg.host(got), want_signs), numel
        for method in ("torch", "triton") if on_cuda() else ("torch",):
            assert torch.equal(tg.host(kernels.pack_signs(dv, method=method)), want_signs), (numel, method)
        for method in METHODS:
            with tg.reference():
                scales = torch.tensor([0.5, -2.0, 3e-39])
                want = kernels.unpack_scaled(want_signs, scales)
            cu = kernels.unpack_scaled(got, tg.tensor(scales), method=method)
            assert torch.equal(_bits(tg.host(cu)), _bits(want)), (numel, method)
            if method == "triton":
                continue  # minus_signed by name: torch ops only
            with tg.reference():
                e = torch.randn(numel, generator=gen)
                s = torch.tensor(0.3)
                want = torch.empty(numel)
                kernels.minus_signed(e, s, out=want)
            out = tg.tensor(torch.zeros(numel))
            kernels.minus_signed(tg.tensor(e), tg.tensor(s), out=out, method=method)
            assert torch.equal(_bits(tg.host(out)), _bits(want)), (numel, method)
        with tg.reference():
            want = kernels.sum_squares(v[1:])
        squares = tg.host(kernels.sum_squares(tg.tensor(v[1:])))
        assert torch.allclose(squares, want, rtol=1e-13, atol=0), numel
        with tg.reference():
            a, b = kernels.scale_of(squares, numel), kernels.scale_of(want, numel)
            assert torch.equal(_bits(a), _bits(b)), f"{numel}: the scale differs in its last bit (possible, rarely)"
        checked.append(numel)
    tg.check()
    return {"sizes": checked, "kernels": kernels.report()}


def case_steps():
    """The worker's and the server's steps and the final unpack on the device against the
    CPU, bit for bit, with the default kernels (Triton's fused passes on CUDA) and the torch
    ops."""
    tg = target()
    n, c = 3, 8 * 700
    out = {}
    for method in (None, "torch"):
        gen = torch.Generator().manual_seed(5)
        with tg.reference():
            x = torch.randn(n * c - 5, generator=gen)
            we = torch.randn(n * c, generator=gen) * 0.1
            se = torch.randn(c, generator=gen)
            send = torch.zeros(n, c // 8 + 4, dtype=torch.uint8)
            row = torch.zeros(1, c // 8 + 4, dtype=torch.uint8)
            d_x, d_we, d_se = x.clone(), we.clone(), se.clone()
            kernels.worker_step(x, we, send)
            kernels.server_step(send, kernels.inverse_size(n, "cpu"), se, row)
            gathered = torch.cat([row] * n)
            final = torch.empty(n * c - 9)
            kernels.unpack_rows(gathered, final)
        dwe, dse = tg.tensor(d_we), tg.tensor(d_se)
        dsend, drow = tg.tensor(torch.zeros(n, c // 8 + 4, dtype=torch.uint8)), tg.tensor(torch.zeros(1, c // 8 + 4, dtype=torch.uint8))
        kernels.worker_step(tg.tensor(d_x), dwe, dsend, method=method)
        assert torch.equal(tg.host(dsend), send) and torch.equal(_bits(tg.host(dwe)), _bits(we)), method
        kernels.server_step(tg.tensor(send), kernels.inverse_size(n, tg.device), dse, drow, method=method)
        assert torch.equal(tg.host(drow), row) and torch.equal(_bits(tg.host(dse)), _bits(se)), method
        dfinal = tg.tensor(torch.zeros(n * c - 9))
        kernels.unpack_rows(tg.tensor(gathered), dfinal)
        assert torch.equal(_bits(tg.host(dfinal)), _bits(final)), method
        out[str(method)] = True
    tg.check()
    return out


@pytest.mark.one_seed
def test_kernels_on_the_device_give_the_cpu_bits(seed):
    res = run(1, "test_cuda_onebit:case_kernels", seed, timeout=240)
    print("1-bit kernels:", res[0]["kernels"])
    if on_cuda():
        assert all(v == "triton" for v in res[0]["kernels"].values()), res[0]["kernels"]


@pytest.mark.one_seed
def test_worker_and_server_steps_on_the_device_give_the_cpu_rows(seed):
    res = run(1, "test_cuda_onebit:case_steps", seed, timeout=240)
    assert res[0] == {"None": True, "torch": True}


# ------------------------------------------------------------------------------ in the ranks


def _inputs(shape, call, gen):
    numel = torch.Size(shape).numel()
    x = torch.randn(numel, generator=gen) * (1.0, 3e-3, 40.0)[call % 3]
    if numel >= 8:
        x[1::7] = 0.0
        x[2::7] = -0.0
    return x.view(shape)


def _check(label, got, want, stats):
    """Output signs equal (the servers' bits), values and errors to 1e-6 relative."""
    got = target().host(got)
    with target().reference():
        assert torch.equal(torch.signbit(got), torch.signbit(want)), f"{label}: output signs differ"
        d = _max_rel(got, want)
        assert d <= 1e-6, f"{label}: output differs by {d} relative"
        stats["worst"] = max(stats["worst"], d)
        stats["bit_equal"] += int(torch.equal(_bits(got), _bits(want)))
    stats["compared"] += 1


def _native_group(dist):
    """The device's own transport for the packed bytes: an nccl group on CUDA; on the fake
    device, an oxcomm group used through torch.distributed (``_TorchBytes``), or None with NCCL's
    reason where NCCL refuses."""
    from oxcomm import onebit_torch

    if not on_cuda():
        group = dist.new_group(backend="oxcomm")
        ar = onebit_torch.CompressedAllreduce(group)
        ar._transports["cuda"] = onebit_torch._TorchBytes(group, list_gather=False)
        return ar, None
    nccl = dist.new_group(backend="nccl")
    try:
        probe = torch.ones(1, device=target().device)
        dist.all_reduce(probe, group=nccl)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - NCCL's refusal, reported as the skip reason
        return None, f"{type(e).__name__}: {str(e)[:300]}"
    ar = onebit_torch.CompressedAllreduce(nccl)
    t = ar._transport(target().device)
    assert isinstance(t, onebit_torch._TorchBytes) and not t.list_gather
    return ar, None


def case_device_matches_host():
    """The Rust path on host tensors against device tensors over oxcomm (staged), gloo, and
    CompressedBackend; then the stream contract and the reuse of the pinned buffers."""
    import torch.distributed as dist

    from oxcomm import onebit_torch
    from oxcomm.deepspeed import CompressedBackend

    tg = target()
    dist.init_process_group("gloo")
    ox = dist.new_group(backend="oxcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    rust = onebit_torch.CompressedAllreduce(ox)
    on_device = {
        "oxcomm": onebit_torch.CompressedAllreduce(ox),
        "gloo": onebit_torch.CompressedAllreduce(None),
        "backend-oxcomm": CompressedBackend(group=ox).compressed_allreduce,
        "backend-default": CompressedBackend().compressed_allreduce,
    }
    assert isinstance(on_device["oxcomm"]._transport(tg.device, True), onebit_torch._Staged)
    stats = {"worst": 0.0, "bit_equal": 0, "compared": 0}
    gen = torch.Generator().manual_seed(21 + rank)
    for shape in [(13,), (padded_len(64, n),), (7, 9), (1000,), (2**20 + 3,)]:
        numel = torch.Size(shape).numel()
        big_n = padded_len(numel, n)
        with tg.reference():
            we0, se0 = torch.randn(big_n, generator=gen) * 0.1, torch.randn(big_n // n, generator=gen) * 0.1
            errs = {"rust": (we0.clone(), se0.clone())}
        errs.update({name: (tg.tensor(we0), tg.tensor(se0)) for name in on_device})
        for call in range(3):
            with tg.reference():
                x = _inputs(shape, call, gen)
                want = rust(x.clone(), *errs["rust"])
            for name, ar in on_device.items():
                dx = tg.tensor(x)
                got = ar(dx, *errs[name])
                label = f"{name} shape {shape} call {call} rank {rank}"
                assert got.shape == x.shape, label
                _check(label, got, want, stats)
                for e_got, e_want in zip(errs[name], errs["rust"]):
                    d = _max_rel(tg.host(e_got), e_want)
                    assert d <= 1e-6, f"{label}: error differs by {d} relative"
                if numel == big_n:
                    assert torch.equal(_bits(tg.host(dx)), _bits(tg.host(got))), f"{label}: not in place"
                else:
                    assert torch.equal(_bits(tg.host(dx)), _bits(x)), f"{label}: padded buffer modified"

    # The stream contract, on a side stream with the input still being written on it.
    ar = on_device["oxcomm"]
    big_n = padded_len(2**20, n)
    with tg.reference():
        src = torch.randn(big_n, generator=gen)
        want = rust(src.clone(), torch.zeros(big_n), torch.zeros(big_n // n))
    we, se = tg.tensor(torch.zeros(big_n)), tg.tensor(torch.zeros(big_n // n))
    side = tg.stream()
    tg.synchronize()
    with tg.on(side):
        tg.delay(0.05)
        x = tg.tensor(src)  # written well after the call is queued
        y = ar(x, we, se)
        after = y * 2.0  # queued after the call on the same stream
        _check(f"stream rank {rank}", y, want, stats)
        assert torch.equal(tg.host(after), want * 2.0), "work queued after the call did not see its result"
    staged = ar._transport(tg.device, True)
    buffers = {k: v[0].data_ptr() for k, v in staged._host.items()}
    for _ in range(3):
        ar(x, we, se)
    assert {k: v[0].data_ptr() for k, v in staged._host.items()} == buffers, "pinned buffers reallocated"
    tg.synchronize()
    dist.barrier()
    tg.check()
    return stats


@pytest.mark.worlds(2, 3)
@pytest.mark.one_seed
def test_device_matches_host(world, seed):
    stats = run(world, "test_cuda_onebit:case_device_matches_host", seed, timeout=300)
    assert all(s["compared"] > 0 for s in stats)
    print(f"device vs host ({world} ranks):", stats)


def case_native():
    """The device's own transport (packed bytes on the device) against the Rust path. Where
    NCCL refuses (more ranks than GPUs) every rank reports NCCL's reason."""
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")
    from oxcomm import onebit_torch

    tg = target()
    dist.init_process_group("gloo")
    ox = dist.new_group(backend="oxcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    ar, refused = _native_group(dist)
    if refused is not None:
        print(_torch_ranks.RESULT + json.dumps({"refused": refused}), flush=True)
        os._exit(0)  # a refused NCCL communicator may hang in teardown
    rust = onebit_torch.CompressedAllreduce(ox)
    stats = {"worst": 0.0, "bit_equal": 0, "compared": 0}
    gen = torch.Generator().manual_seed(31 + rank)
    for shape in [(13,), (1000,), (2**20 + 3,)]:
        numel = torch.Size(shape).numel()
        big_n = padded_len(numel, n)
        with tg.reference():
            we0, se0 = torch.randn(big_n, generator=gen) * 0.1, torch.randn(big_n // n, generator=gen) * 0.1
            we_c, se_c = we0.clone(), se0.clone()
        we_g, se_g = tg.tensor(we0), tg.tensor(se0)
        for call in range(3):
            with tg.reference():
                x = _inputs(shape, call, gen)
                want = rust(x.clone(), we_c, se_c)
            got = ar(tg.tensor(x), we_g, se_g)
            _check(f"native shape {shape} call {call} rank {rank}", got, want, stats)
            assert _max_rel(tg.host(we_g), we_c) <= 1e-6 and _max_rel(tg.host(se_g), se_c) <= 1e-6
    tg.synchronize()
    dist.barrier()
    tg.check()
    return stats


@pytest.mark.one_seed
def test_native_group_one_rank(seed):
    stats = run(1, "test_cuda_onebit:case_native", seed, timeout=120)
    assert "refused" not in stats[0], stats[0]
    assert stats[0]["compared"] > 0


@pytest.mark.one_seed
def test_native_group_2_ranks(seed):
    stats = run(2, "test_cuda_onebit:case_native", seed, timeout=120)
    if any("refused" in s for s in stats) and on_cuda() and torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL refuses 2 ranks on one GPU: {stats[0].get('refused', stats)}")
    assert all(s["compared"] > 0 for s in stats), stats
