"""DeepSpeed on oxcomm: ``deepspeed.comm`` after ``init_distributed(dist_backend="oxcomm")``,
``CompressedBackend`` against DeepSpeed's own ``compressed_allreduce`` formulas (re-implemented
below from DeepSpeed 0.19.7's ``deepspeed/runtime/comm/nccl.py``, over gloo), ``OnebitAdam``
against plain Adam on the example model, ZeRO++'s coalesced and quantized reduce-scatters, and
the example script end to end.

The first DeepSpeed init on a machine JIT-builds DeepSpeed's shared-memory op (minutes on a
loaded machine; cached in ~/.cache/torch_extensions afterwards), hence the long deadlines.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import _torch_ranks

pytest.importorskip("deepspeed")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
DS_DEADLINE = 900  # covers DeepSpeed's one-time JIT build of its shm op


# ------------------------------------------------------------------------------- in the ranks


def _ds_init():
    import torch

    import oxcomm.deepspeed
    import deepspeed

    torch.set_num_threads(1)
    oxcomm.deepspeed.init_distributed(verbose=False)
    return deepspeed.comm


def ds_reference_compressed_allreduce(buffer_m, worker_error, server_error, group, size):
    """DeepSpeed 0.19.7's ``NcclBackend.compressed_allreduce`` (deepspeed/runtime/comm/nccl.py),
    line by line, with cupy's packbits/unpackbits replaced by numpy's (same big-endian bit
    order) and the collectives run on ``group`` (gloo). Same return value and in-place rules."""
    import numpy as np
    import torch
    import torch.distributed as dist

    original_shape = buffer_m.size()
    if len(original_shape) > 1:
        buffer_m = torch.flatten(buffer_m)
    original_size = buffer_m.numel()
    worker_error_size = worker_error.numel()
    if original_size == 0:
        if worker_error_size:
            worker_error.zero_()
        if server_error.numel():
            server_error.zero_()
        return buffer_m.reshape(original_shape) if len(original_shape) > 1 else buffer_m
    if original_size != worker_error_size:
        empty_tensor = torch.zeros(worker_error_size - original_size, device=buffer_m.device)
        buffer_m = torch.cat([buffer_m, empty_tensor])

    buffer_m.add_(worker_error)
    worker_scale = torch.linalg.norm(buffer_m) / np.sqrt(buffer_m.numel())
    worker_error.set_(buffer_m - worker_scale * buffer_m.sign().add_(1).bool().float().add_(-0.5).mul_(2.0))

    packed = np.packbits(buffer_m.sign_().add_(1).bool().to(dtype=torch.uint8).numpy())
    sign_list_packed = [torch.from_numpy(c.copy()) for c in np.split(packed, size)]
    recvbuf_sign = torch.zeros([size, sign_list_packed[0].numel()], dtype=torch.uint8)
    recvbuf_scale = [torch.zeros(1, dtype=worker_scale.dtype) for _ in range(size)]
    dist.all_to_all_single(recvbuf_sign, torch.stack(sign_list_packed), group=group)
    dist.all_gather(recvbuf_scale, worker_scale.reshape(1), group=group)

    compensated_server_m = (
        torch.from_numpy(np.unpackbits(recvbuf_sign.flatten().numpy()))
        .reshape(size, -1)
        .float()
        .add_(-0.5)
        .mul_(2.0)
        .mul_(torch.stack(recvbuf_scale).mul_(1 / size))
        .sum(0)
    )
    compensated_server_m.add_(server_error)
    server_scale = torch.linalg.norm(compensated_server_m) / np.sqrt(compensated_server_m.numel())
    server_error.set_(
        compensated_server_m - server_scale * compensated_server_m.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)
    )
    server_packed = torch.from_numpy(
        np.packbits(compensated_server_m.sign_().add_(1).bool().to(dtype=torch.uint8).numpy())
    )
    recvbuf_sign_server = [torch.zeros(server_packed.numel(), dtype=torch.uint8) for _ in range(size)]
    recvbuf_scale_server = [torch.zeros(1, dtype=worker_scale.dtype) for _ in range(size)]
    dist.all_gather(recvbuf_sign_server, server_packed, group=group)
    dist.all_gather(recvbuf_scale_server, server_scale.reshape(1), group=group)
    recvbuf_sign_server = torch.stack(recvbuf_sign_server)
    buffer_m.data.copy_(
        torch.from_numpy(np.unpackbits(recvbuf_sign_server.flatten().numpy()))
        .reshape(size, -1)
        .float()
        .add_(-0.5)
        .mul_(2.0)
        .mul_(torch.stack(recvbuf_scale_server))
        .flatten()
        .data
    )
    if original_size != worker_error_size:
        buffer_m = buffer_m[0:original_size]
    if len(original_shape) > 1:
        buffer_m = buffer_m.reshape(original_shape)
    return buffer_m


def _padded(numel, n):
    import math

    divider = n * 8 // math.gcd(n, 8)
    multiple = n * divider
    return (numel + multiple - 1) // multiple * multiple


def case_compressed_backend():
    """CompressedBackend's output and errors against DeepSpeed's formulas, to 1e-6 (relative
    to the tensor's largest magnitude when that is above 1), over
    several error-feedback iterations, for padded, unpadded (in place) and 2-D buffers."""
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401
    from oxcomm.deepspeed import CompressedBackend

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    gloo = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    backend = CompressedBackend()
    assert (backend.rank, backend.size) == (rank, n)
    gen = torch.Generator().manual_seed(7 + rank)
    worst = 0.0
    for shape in [(1000,), (_padded(64, n),), (7, 9), (3, 5, 11), (1,)]:
        numel = torch.Size(shape).numel()
        big_n = _padded(numel, n)
        we_ox, se_ox = torch.zeros(big_n), torch.zeros(big_n // n)
        we_ds, se_ds = torch.zeros(big_n), torch.zeros(big_n // n)
        for it in range(4):
            x = torch.randn(shape, generator=gen) * (1 + it)
            x_ox, x_ds = x.clone(), x.clone()
            got = backend.compressed_allreduce(x_ox, we_ox, se_ox, 0)
            want = ds_reference_compressed_allreduce(x_ds, we_ds, se_ds, gloo, n)
            assert got.shape == want.shape == x.shape, (got.shape, want.shape)
            for name, a, b in (("output", got, want), ("worker_error", we_ox, we_ds), ("server_error", se_ox, se_ds)):
                # 1e-6 of the tensor's largest magnitude: the scales are norms that oxcomm sums in
                # f64 and DeepSpeed in f32, so values near 8 may differ by their last f32 bit.
                d = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
                worst = max(worst, d)
                assert d <= 1e-6, (
                    f"{name} shape {shape} iteration {it}: max |oxcomm - DeepSpeed| / max|DeepSpeed| = {d}"
                )
            # DeepSpeed's in-place rule: a contiguous buffer of exactly N elements holds the result
            if numel == big_n:
                assert torch.equal(x_ox, got), "unpadded buffer not updated in place"
            else:
                assert torch.equal(x_ox, x), "padded buffer modified"
            # every rank holds the same result
            ref = got.clone()
            dist.broadcast(ref, src=0, group=gloo)
            assert torch.equal(ref, got)
    # the empty buffer: errors zeroed, nothing sent
    we, se = torch.ones(16 * n), torch.ones(16)
    out = backend.compressed_allreduce(torch.zeros(0), we, se, 0)
    assert out.numel() == 0 and not we.any() and not se.any()
    # bad input is named before anything is sent
    for args, word in (
        ((torch.zeros(10, dtype=torch.float64), torch.zeros(16 * n), torch.zeros(16)), "buffer_m"),
        ((torch.zeros(10), torch.zeros(15 * n), torch.zeros(15)), "worker_error"),
        ((torch.zeros(10), torch.zeros(16 * n), torch.zeros(8)), "server_error"),
        ((torch.zeros(100 * n), torch.zeros(16 * n), torch.zeros(16)), "buffer_m"),
    ):
        try:
            backend.compressed_allreduce(*args, 0)
            raise AssertionError(f"bad {word} accepted")
        except (TypeError, ValueError) as e:
            assert word in str(e), e
    dist.barrier()
    return worst


def case_ds_comm():
    """deepspeed.comm calls after init_distributed("oxcomm"), with DeepSpeed's comms logger."""
    import torch

    ds = _ds_init()
    import deepspeed

    ds.configure(enabled=True, prof_all=True, verbose=False)
    assert ds.get_world_size() == int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    assert dist.get_backend() == "oxcomm"
    rank, n = ds.get_rank(), ds.get_world_size()
    t = torch.arange(8, dtype=torch.float32) + rank
    ds.all_reduce(t)
    assert torch.equal(t, torch.arange(8, dtype=torch.float32) * n + sum(range(n))), t
    t = torch.full((5,), float(rank))
    ds.broadcast(t, src=n - 1)
    assert torch.equal(t, torch.full((5,), float(n - 1)))
    out = torch.zeros(n * 3)
    ds.all_gather_into_tensor(out, torch.full((3,), float(rank)))
    assert torch.equal(out, torch.arange(n).repeat_interleave(3).float())
    outs = [torch.zeros(2) for _ in range(n)]
    ds.all_gather(outs, torch.full((2,), float(rank)))
    assert [o[0].item() for o in outs] == list(range(n))
    rs = torch.zeros(4)
    ds.reduce_scatter_tensor(rs, torch.arange(4 * n, dtype=torch.float32))
    assert torch.equal(rs, (torch.arange(4, dtype=torch.float32) + 4 * rank) * n)
    a2a = torch.zeros(n)
    ds.all_to_all_single(a2a, torch.arange(n, dtype=torch.float32) + 10 * rank)
    assert torch.equal(a2a, torch.tensor([10.0 * k + rank for k in range(n)]))
    ds.barrier()
    g = ds.new_group(ranks=list(range(n)))
    t = torch.ones(3)
    ds.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((3,), float(n)))
    summary = deepspeed.comm.log_summary() if hasattr(deepspeed.comm, "log_summary") else None
    return {"summary": summary is None or isinstance(summary, (str, type(None)))}


def case_coalesced():
    """reduce_scatter_coalesced against DeepSpeed's own (run on gloo), and qgZ against the
    exact mean within int4 quantization error."""
    import torch
    import torch.distributed as dist

    ds = _ds_init()
    from deepspeed.runtime.comm import coalesced_collectives as cc

    import oxcomm.deepspeed as oxds

    rank, n = ds.get_rank(), ds.get_world_size()
    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(rank)
    shapes = [(13,), (64,), (7, 5), (0,), (4 * n,)]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    got = oxds.reduce_scatter_coalesced([t.clone() for t in tensors])
    want = cc.reduce_scatter_coalesced([t.clone() for t in tensors], group=gloo)
    assert len(got) == len(want)
    for s, a, b in zip(shapes, got, want):
        assert a.shape == b.shape, (s, a.shape, b.shape)
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (s, (a - b).abs().max())
    # qgZ: 2-D tensors whose size is a multiple of 2 × world
    qs = [torch.randn(8 * n, 16, generator=gen), torch.randn(2 * n, 32, generator=gen)]
    got = oxds.all_to_all_quant_reduce([q.clone() for q in qs], {})
    for q, a in zip(qs, got):
        mean = q.clone()
        dist.all_reduce(mean, group=gloo)
        mean = mean.view(-1) / n
        part = mean.numel() // n
        exact = mean[rank * part : (rank + 1) * part]
        assert a.numel() == exact.numel(), (a.shape, exact.shape)
        err = (a.view(-1) - exact).abs().max().item()
        assert err <= 0.25 * exact.abs().max().item() + 1e-6, f"qgZ error {err}"
    return True


def case_onebit_adam():
    """OnebitAdam reaches the loss of plain (exact, data-parallel) Adam within 2% on the
    example model."""
    import importlib.util

    import torch
    import torch.distributed as dist

    import oxcomm.torch as oxtorch

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    spec = importlib.util.spec_from_file_location("deepspeed_train", os.path.join(EXAMPLES, "deepspeed_train.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    steps = ex.DEFAULT_STEPS
    losses = {}
    for name in ("adam", "onebit"):
        model = ex.make_model(seed=0)
        if name == "adam":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.Adam(ddp.parameters(), lr=ex.LR)
            net = ddp
        else:
            opt = oxtorch.OnebitAdam(model.parameters(), lr=ex.LR, freeze_step=steps // 5)
            net = model
        data = ex.make_data(dist.get_rank())
        for step in range(steps):
            x, y = ex.batch(data, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        losses[name] = ex.evaluate(model)
    assert losses["onebit"] <= losses["adam"] * 1.02, losses
    return losses


def case_onebit_adam_mask():
    """DeepSpeed's ``exp_avg_mask``: a parameter half of whose gradient is always zero. Once
    frozen, the masked half stays where it is; without the mask the 1-bit momentum (which cannot
    be zero) moves it by about lr · scale / eps per step."""
    import torch
    import torch.distributed as dist

    import oxcomm.torch as oxtorch

    torch.set_num_threads(1)
    dist.init_process_group("oxcomm")
    moved = {}
    for masked in (False, True):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64))
        start = w.detach().clone()
        mask = torch.cat([torch.ones(32), torch.zeros(32)])
        group = {"params": [w], "exp_avg_mask": mask} if masked else {"params": [w]}
        opt = oxtorch.OnebitAdam([group], lr=1e-3, freeze_step=3)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(6):
            opt.zero_grad()
            x = torch.randn(64, generator=gen) * mask  # the second half never gets a gradient
            (w * x).sum().backward()
            opt.step()
        moved[masked] = (w.detach() - start)[32:].abs().max().item()
    assert moved[True] == 0.0, moved
    assert moved[False] > 1.0, moved
    return moved


# ------------------------------------------------------------------------------- in pytest


def test_compressed_backend_matches_deepspeed_formulas():
    res = _torch_ranks.run(2, "test_deepspeed:case_compressed_backend", timeout=180)
    assert max(res) <= 1e-6


def test_compressed_backend_matches_deepspeed_formulas_3_ranks():
    _torch_ranks.run(3, "test_deepspeed:case_compressed_backend", timeout=240)


def test_deepspeed_comm_on_oxcomm():
    _torch_ranks.run(2, "test_deepspeed:case_ds_comm", timeout=DS_DEADLINE)


def test_coalesced_and_quantized_reduce_scatter():
    _torch_ranks.run(2, "test_deepspeed:case_coalesced", timeout=DS_DEADLINE)


def test_onebit_adam_within_2_percent_of_adam():
    res = _torch_ranks.run(2, "test_deepspeed:case_onebit_adam", timeout=300)
    assert res[0] == res[1]


def test_onebit_adam_exp_avg_mask_keeps_zero_gradients_still():
    _torch_ranks.run(2, "test_deepspeed:case_onebit_adam_mask", timeout=180)


def test_example_deepspeed_train():
    """The README's one-command example, under torchrun (it picks a free port itself)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(EXAMPLES, "deepspeed_train.py"),
        "--steps",
        "30",
    ]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DS_DEADLINE)
    except subprocess.TimeoutExpired:
        _torch_ranks._kill(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"deepspeed_train.py timed out\n{out.decode(errors='replace')[-4000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    assert "final loss" in text, text[-4000:]
