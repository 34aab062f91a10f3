"""The 1-bit compressed all-reduce on CUDA tensors against the same call on CPU tensors.

CPU twins: ``tests/test_onebit_torch.py`` (the same kernels and transports on CPU tensors,
against the Rust path). Here the kernels run on ``cuda:0``, with 2 and 3 ranks sharing it:

* the kernels alone, CUDA against CPU on the same inputs: sign bytes and rows equal, bit
  for bit (the sums of squares may differ in their last float64 bits: see
  ``oxcomm._onebit_kernels``);
* whole calls over the oxcomm transport (staged through pinned buffers), a gloo group and an
  nccl group, and ``CompressedBackend``, against the Rust path on CPU tensors: the signs of
  the output (the servers' sign bits) equal, values and both errors within 1e-6 relative;
* the stream contract: a call on a side stream whose input is still being written by earlier
  work on that stream reads the finished input, and later work on that stream sees the
  result, with no synchronisation by the caller; the pinned buffers are reused.

NCCL refuses two ranks on one GPU ("duplicate GPU"): that case is skipped with NCCL's reason,
and the nccl transport is checked on a one-rank group instead (the same code path).
"""

from __future__ import annotations

import json
import os

import pytest

import _torch_ranks
from conftest import RANKS_ENV

torch = pytest.importorskip("torch")

from oxcomm import _onebit_kernels as kernels  # noqa: E402
from oxcomm.onebit_torch import padded_len  # noqa: E402

CUDA = torch.device("cuda", 0)


def _bits(t):
    return t.contiguous().view(torch.int32)


def _max_rel(a, b):
    a, b = a.cpu(), b.cpu()
    return (a - b).abs().max().item() / max(1e-30, b.abs().max().item()) if b.numel() else 0.0


# ------------------------------------------------------------------------------ kernels, in pytest


def test_kernels_on_cuda_give_the_cpu_bits():
    gen = torch.Generator().manual_seed(4)
    for numel in (64, 8 * 1001, 3 * 2**20):
        v = torch.randn(3, numel, generator=gen)
        v[:, 1::7] = 0.0
        v[:, 2::7] = -0.0
        v[0, 5] = float("nan")
        got = kernels.pack_signs(v.to(CUDA))  # Triton's where it runs
        assert torch.equal(got.cpu(), kernels.pack_signs(v)), numel
        assert torch.equal(kernels.pack_signs(v.to(CUDA), method="torch").cpu(), got.cpu()), numel
        for method in ("triton", "select", "flip"):
            scales = torch.tensor([0.5, -2.0, 3e-39])
            cu = kernels.unpack_scaled(got, scales.to(CUDA), method=method)
            assert torch.equal(_bits(cu.cpu()), _bits(kernels.unpack_scaled(got.cpu(), scales))), (numel, method)
            if method == "triton":
                continue  # minus_signed has torch ops only
            e = torch.randn(numel, generator=gen)
            s = torch.tensor(0.3)
            out = torch.empty(numel, device=CUDA)
            kernels.minus_signed(e.to(CUDA), s.to(CUDA), out=out, method=method)
            want = torch.empty(numel)
            kernels.minus_signed(e, s, out=want)
            assert torch.equal(_bits(out.cpu()), _bits(want)), (numel, method)
        squares = kernels.sum_squares(v[1:].to(CUDA)).cpu()
        want = kernels.sum_squares(v[1:])
        assert torch.allclose(squares, want, rtol=1e-13, atol=0), numel
        assert torch.equal(
            _bits(kernels.scale_of(squares, numel)), _bits(kernels.scale_of(want, numel))
        ), f"{numel}: the scale differs in its last bit (possible, rarely: see _onebit_kernels)"
    print("Triton kernels:", "used" if kernels._triton["module"] else f"not used ({kernels._triton['failed']})")


@pytest.mark.parametrize("method", [None, "torch"])  # None: Triton's fused passes where they run
def test_worker_and_server_steps_on_cuda_give_the_cpu_rows(method):
    gen = torch.Generator().manual_seed(5)
    n, c = 3, 8 * 700
    x = torch.randn(n * c - 5, generator=gen)
    we = torch.randn(n * c, generator=gen) * 0.1
    send = torch.empty(n, c // 8 + 4, dtype=torch.uint8)
    we_cu, send_cu = we.to(CUDA, copy=True), send.to(CUDA, copy=True)
    kernels.worker_step(x, we, send)
    kernels.worker_step(x.to(CUDA), we_cu, send_cu, method=method)
    assert torch.equal(send_cu.cpu(), send)
    assert torch.equal(_bits(we_cu.cpu()), _bits(we))
    se = torch.randn(c, generator=gen)
    se_cu = se.to(CUDA, copy=True)
    row, row_cu = torch.empty(1, c // 8 + 4, dtype=torch.uint8), torch.empty(1, c // 8 + 4, dtype=torch.uint8, device=CUDA)
    kernels.server_step(send, kernels.inverse_size(n, "cpu"), se, row)
    kernels.server_step(send_cu, kernels.inverse_size(n, CUDA), se_cu, row_cu, method=method)
    assert torch.equal(row_cu.cpu(), row)
    assert torch.equal(_bits(se_cu.cpu()), _bits(se))
    gathered = torch.cat([row] * n)
    out, out_cu = torch.empty(n * c - 9), torch.empty(n * c - 9, device=CUDA)
    kernels.unpack_rows(gathered, out)
    kernels.unpack_rows(gathered.to(CUDA), out_cu)
    assert torch.equal(_bits(out_cu.cpu()), _bits(out))


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
    got = got.cpu()
    assert torch.equal(torch.signbit(got), torch.signbit(want)), f"{label}: output signs differ"
    d = _max_rel(got, want)
    assert d <= 1e-6, f"{label}: output differs by {d} relative"
    stats["worst"] = max(stats["worst"], d)
    stats["bit_equal"] += int(torch.equal(_bits(got), _bits(want)))
    stats["compared"] += 1


def case_cuda_matches_cpu():
    """The Rust path on CPU tensors against CUDA tensors over oxcomm (staged), gloo, and
    CompressedBackend; then the stream contract and the reuse of the pinned buffers."""
    import torch.distributed as dist

    from oxcomm import onebit_torch
    from oxcomm.deepspeed import CompressedBackend

    torch.cuda.set_device(CUDA)
    dist.init_process_group("gloo")
    ox = dist.new_group(backend="oxcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    rust = onebit_torch.CompressedAllreduce(ox)
    on_cuda = {
        "oxcomm": onebit_torch.CompressedAllreduce(ox),
        "gloo": onebit_torch.CompressedAllreduce(None),
        "backend-oxcomm": CompressedBackend(group=ox).compressed_allreduce,
        "backend-default": CompressedBackend().compressed_allreduce,
    }
    assert isinstance(on_cuda["oxcomm"]._transport(CUDA), onebit_torch._Staged)
    stats = {"worst": 0.0, "bit_equal": 0, "compared": 0}
    gen = torch.Generator().manual_seed(21 + rank)
    for shape in [(13,), (padded_len(64, n),), (7, 9), (1000,), (2**20 + 3,), (padded_len(2**21, n),)]:
        numel = torch.Size(shape).numel()
        big_n = padded_len(numel, n)
        we0, se0 = torch.randn(big_n, generator=gen) * 0.1, torch.randn(big_n // n, generator=gen) * 0.1
        errs = {"rust": (we0.clone(), se0.clone())}
        errs.update({name: (we0.to(CUDA, copy=True), se0.to(CUDA, copy=True)) for name in on_cuda})
        for call in range(3):
            x = _inputs(shape, call, gen)
            want = rust(x.clone(), *errs["rust"])
            for name, ar in on_cuda.items():
                x_cu = x.to(CUDA, copy=True)
                got = ar(x_cu, *errs[name])
                label = f"{name} shape {shape} call {call} rank {rank}"
                assert got.device == CUDA and got.shape == x.shape, label
                _check(label, got, want, stats)
                for e_got, e_want in zip(errs[name], errs["rust"]):
                    d = _max_rel(e_got, e_want)
                    assert d <= 1e-6, f"{label}: error differs by {d} relative"
                if numel == big_n:
                    assert torch.equal(_bits(x_cu.cpu()), _bits(got.cpu())), f"{label}: not in place"
                else:
                    assert torch.equal(_bits(x_cu.cpu()), _bits(x)), f"{label}: padded buffer modified"

    # The stream contract, on a side stream with the input still being written on it.
    ar = on_cuda["oxcomm"]
    big_n = padded_len(2**20, n)
    src = torch.randn(big_n, generator=gen)
    we_cpu, se_cpu = torch.zeros(big_n), torch.zeros(big_n // n)
    want = rust(src.clone(), we_cpu, se_cpu)
    we, se = torch.zeros(big_n, device=CUDA), torch.zeros(big_n // n, device=CUDA)
    src_cu = src.to(CUDA)
    x = torch.zeros(big_n, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the input is written well after the call is queued
        x.copy_(src_cu)
        y = ar(x, we, se)
        after = y * 2.0  # queued after the call on the same stream
    side.synchronize()
    _check(f"stream rank {rank}", y, want, stats)
    assert torch.equal(after.cpu(), want * 2.0), "work queued after the call did not see its result"
    staged = ar._transport(CUDA)
    buffers = dict(staged._host)
    for _ in range(3):
        ar(x, we, se)
    assert staged._host.keys() == buffers.keys() and all(
        staged._host[k][0].data_ptr() == buffers[k][0].data_ptr() for k in buffers
    ), "pinned buffers reallocated"
    assert all(b.is_pinned() for pair in staged._host.values() for b in pair)
    torch.cuda.synchronize()
    dist.barrier()
    return stats


def test_cuda_matches_cpu_2_ranks():
    stats = _torch_ranks.run(2, "test_cuda_onebit:case_cuda_matches_cpu", timeout=180, env=RANKS_ENV)
    assert all(s["compared"] > 0 for s in stats)
    print("cuda vs cpu (2 ranks):", stats)


def test_cuda_matches_cpu_3_ranks():
    stats = _torch_ranks.run(3, "test_cuda_onebit:case_cuda_matches_cpu", timeout=180, env=RANKS_ENV)
    assert all(s["compared"] > 0 for s in stats)
    print("cuda vs cpu (3 ranks):", stats)


def case_nccl():
    """The nccl transport (packed bytes on the device, through NCCL) against the Rust path.
    With more ranks than GPUs NCCL may refuse: then every rank reports NCCL's reason."""
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")
    from oxcomm import onebit_torch

    torch.cuda.set_device(CUDA)
    dist.init_process_group("gloo")
    ox = dist.new_group(backend="oxcomm")
    rank, n = dist.get_rank(), dist.get_world_size()
    nccl = dist.new_group(backend="nccl")
    try:
        probe = torch.ones(1, device=CUDA)
        dist.all_reduce(probe, group=nccl)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - NCCL's refusal, reported as the skip reason
        print(_torch_ranks.RESULT + json.dumps({"refused": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        os._exit(0)  # a refused NCCL communicator may hang in teardown
    rust = onebit_torch.CompressedAllreduce(ox)
    ar = onebit_torch.CompressedAllreduce(nccl)
    assert isinstance(ar._transport(CUDA), onebit_torch._TorchBytes) and not ar._transport(CUDA).list_gather
    stats = {"worst": 0.0, "bit_equal": 0, "compared": 0}
    gen = torch.Generator().manual_seed(31 + rank)
    for shape in [(13,), (1000,), (2**20 + 3,)]:
        numel = torch.Size(shape).numel()
        big_n = padded_len(numel, n)
        we0, se0 = torch.randn(big_n, generator=gen) * 0.1, torch.randn(big_n // n, generator=gen) * 0.1
        we_c, se_c = we0.clone(), se0.clone()
        we_g, se_g = we0.to(CUDA, copy=True), se0.to(CUDA, copy=True)
        for call in range(3):
            x = _inputs(shape, call, gen)
            want = rust(x.clone(), we_c, se_c)
            got = ar(x.to(CUDA, copy=True), we_g, se_g)
            _check(f"nccl shape {shape} call {call} rank {rank}", got, want, stats)
            assert _max_rel(we_g, we_c) <= 1e-6 and _max_rel(se_g, se_c) <= 1e-6
    torch.cuda.synchronize()
    dist.barrier()
    return stats


def test_nccl_group_one_rank():
    stats = _torch_ranks.run(1, "test_cuda_onebit:case_nccl", timeout=120, env=RANKS_ENV)
    assert "refused" not in stats[0], stats[0]
    assert stats[0]["compared"] > 0


def test_nccl_group_2_ranks_on_one_gpu():
    stats = _torch_ranks.run(2, "test_cuda_onebit:case_nccl", timeout=120, env=RANKS_ENV)
    if any("refused" in s for s in stats) and torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL refuses 2 ranks on one GPU: {stats[0].get('refused', stats)}")
    assert all(s["compared"] > 0 for s in stats), stats
