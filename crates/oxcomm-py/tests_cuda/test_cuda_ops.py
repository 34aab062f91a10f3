"""Every op of the ``"oxcomm"`` torch backend and of ``oxcomm.Communicator`` on CUDA tensors,
2 and 3 ranks sharing ``cuda:0``, compared exactly with the same op on CPU tensors
(integer-valued data), sync and async, on a non-default current stream with work queued just
before the op (a delayed kernel that writes the input) and just after (a kernel that reads the
output), and no synchronize in between; a DDP run on CUDA against gloo's CUDA DDP.

CPU twins: ``tests/test_cuda_staging.py`` (the same staging code on a fake device whose copies
run late). The ranks' worker functions also run on CPU tensors (``OXCOMM_TEST_DEVICE=cpu``), which
is how this file's own logic was checked on a machine without a GPU.
"""

from __future__ import annotations

import os

import pytest
from conftest import RANKS_ENV

import _torch_ranks

torch = pytest.importorskip("torch")

# ------------------------------------------------------------------------------- in the ranks


def _device():
    return torch.device(os.environ.get("OXCOMM_TEST_DEVICE", "cuda:0"))


def _init(spec="oxcomm"):
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(spec)
    return dist


def _data(dtype, n, rank, salt=0):
    if dtype.is_floating_point:
        return ((torch.arange(n, dtype=torch.float64) * 7 + rank * 3 + salt) % 5 - 2).to(dtype)
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 - 5).to(dtype)


class _Side:
    """Tensors for one run of an op: on the CPU (the reference) or on the device, where each
    input is written by a kernel queued on the current stream just before the op (after a
    delay kernel, so that an op that does not wait for the stream reads stale memory), and the
    outputs are read by a kernel queued just after it."""

    def __init__(self, device, finish):
        self.device, self.finish = device, finish
        self.cuda = device.type == "cuda"

    def t(self, values):
        if not self.cuda:
            return values.clone()
        src = values.to(self.device)
        x = torch.full_like(src, 77)
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the write
        x.copy_(src)
        return x

    def done(self, work):
        if work is None:
            return
        if self.finish == "wait":
            work.wait()
        elif self.finish == "future":
            work.get_future().wait()
            assert work.is_completed()

    def read(self, outs):
        if not self.cuda:
            return [o.clone() for o in outs]
        copies = [o.clone() for o in outs]  # queued on the current stream, right after the op
        torch.cuda.current_stream().synchronize()
        return [c.cpu() for c in copies]


def _cases(dist, rank, n, dtype):
    """name -> fn(side, async) -> tensors to compare, through torch.distributed's functions."""
    R = dist.ReduceOp
    D = lambda k, salt=0: _data(dtype, k, rank, salt)  # noqa: E731
    L = 3 * 1024 * 1024 // 4 + 5  # a few 4 MiB chunks' worth in 4-byte dtypes, odd length
    cases = {}

    def case(name):
        def put(fn):
            cases[name] = fn
            return fn

        return put

    @case("all_reduce large")
    def _(s, a):
        x = s.t(D(L))
        s.done(dist.all_reduce(x, async_op=a))
        return [x]

    @case("all_reduce max")
    def _(s, a):
        x = s.t(D(1000))
        s.done(dist.all_reduce(x, op=R.MAX, async_op=a))
        return [x]

    @case("all_reduce non-contiguous")
    def _(s, a):
        x = s.t(D(64)).view(8, 8).t()
        s.done(dist.all_reduce(x, async_op=a))
        return [x.contiguous()]

    @case("all_gather")
    def _(s, a):
        outs = [s.t(torch.zeros(1000, dtype=dtype)) for _ in range(n)]
        s.done(dist.all_gather(outs, s.t(D(1000)), async_op=a))
        return outs

    @case("all_gather_into_tensor")
    def _(s, a):
        out = s.t(torch.zeros(n * 999, dtype=dtype))
        s.done(dist.all_gather_into_tensor(out, s.t(D(999)), async_op=a))
        return [out]

    @case("reduce_scatter")
    def _(s, a):
        out = s.t(torch.zeros(500, dtype=dtype))
        s.done(dist.reduce_scatter(out, [s.t(D(500, salt=k)) for k in range(n)], async_op=a))
        return [out]

    @case("reduce_scatter_tensor")
    def _(s, a):
        out = s.t(torch.zeros(500, dtype=dtype))
        s.done(dist.reduce_scatter_tensor(out, s.t(D(500 * n)), async_op=a))
        return [out]

    @case("all_to_all")
    def _(s, a):
        outs = [s.t(torch.zeros(33, dtype=dtype)) for _ in range(n)]
        s.done(dist.all_to_all(outs, [s.t(D(33, salt=k)) for k in range(n)], async_op=a))
        return outs

    @case("all_to_all_single split sizes")
    def _(s, a):
        ins = [1 + rank + k for k in range(n)]
        outs = [1 + k + rank for k in range(n)]
        out = s.t(torch.zeros(sum(outs), 3, dtype=dtype))
        s.done(dist.all_to_all_single(out, s.t(D(sum(ins) * 3)).view(-1, 3), outs, ins, async_op=a))
        return [out]

    for root in range(n):

        @case(f"broadcast {root}")
        def _(s, a, root=root):
            x = s.t(D(L))
            s.done(dist.broadcast(x, src=root, async_op=a))
            return [x]

        @case(f"reduce {root}")
        def _(s, a, root=root):
            x = s.t(D(L))
            s.done(dist.reduce(x, dst=root, async_op=a))
            return [x] if rank == root else []

        @case(f"gather {root}")
        def _(s, a, root=root):
            outs = [s.t(torch.zeros(77, dtype=dtype)) for _ in range(n)] if rank == root else None
            s.done(dist.gather(s.t(D(77)), outs, dst=root, async_op=a))
            return outs or []

        @case(f"scatter {root}")
        def _(s, a, root=root):
            out = s.t(torch.zeros(77, dtype=dtype))
            ins = [s.t(D(77, salt=k)) for k in range(n)] if rank == root else None
            s.done(dist.scatter(out, ins, src=root, async_op=a))
            return [out]

    @case("isend/irecv ring")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = s.t(torch.zeros(4097, dtype=dtype))
        works = [dist.isend(s.t(D(4097)), dst=right), dist.irecv(out, src=left)]
        for w in works:
            s.done(w) if a else w.wait()
        return [out]

    @case("batch_isend_irecv")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = s.t(torch.zeros(100, dtype=dtype))
        ops = [dist.P2POp(dist.isend, s.t(D(100)), right), dist.P2POp(dist.irecv, out, left)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return [out]

    return cases


def case_torch_ops():
    """Every torch.distributed call on the device against the same call on CPU tensors, both
    on the oxcomm default group, for f32, bf16 and i64, sync / async + wait / async + future, on
    a non-default current stream."""
    dist = _init()
    rank, n = dist.get_rank(), dist.get_world_size()
    device = _device()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    checked = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for name, fn in _cases(dist, rank, n, dtype).items():
            for finish in ("sync", "wait", "future"):
                a = finish != "sync"
                want = _Side(torch.device("cpu"), finish).read(fn(_Side(torch.device("cpu"), finish), a))
                side = _Side(device, finish)
                if cuda:
                    with torch.cuda.stream(stream):
                        got = side.read(fn(side, a))
                else:
                    got = side.read(fn(side, a))
                assert len(got) == len(want), name
                for i, (g, w) in enumerate(zip(got, want)):
                    assert g.dtype == w.dtype and g.shape == w.shape, (name, i)
                    assert torch.equal(g, w), (
                        f"rank {rank}: {name} {dtype} {finish} [{i}]: cuda {g.flatten()[:8].tolist()} "
                        f"!= cpu {w.flatten()[:8].tolist()}"
                    )
                checked.append(f"{name} {dtype} {finish}")
    # a CUDA tensor and a CPU tensor in one call: a named error
    if cuda:
        try:
            dist.all_gather_into_tensor(torch.zeros(n), torch.zeros(1, device=device))
            raise AssertionError("mixed devices: no error")
        except ValueError as e:
            assert "all_gather_into_tensor" in str(e), e
        checked.append("mixed devices refused")
    # object collectives and barrier on a group that serves cuda
    got = [None] * n
    dist.all_gather_object(got, {"rank": rank})
    assert got == [{"rank": r} for r in range(n)], got
    dist.barrier()
    checked.append("objects and barrier")
    return checked


def case_communicator_ops():
    """oxcomm.Communicator's own ops on device tensors, sync and async, against host tensors."""
    import oxcomm.torch

    dist = _init()
    comm = oxcomm.torch.communicator()
    rank, n = comm.rank, comm.size
    device = _device()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    D = lambda k, salt=0: _data(torch.float32, k, rank, salt)  # noqa: E731
    L = 2 * 1024 * 1024 + 3
    ops = {
        "all_reduce": lambda s, a: _one(s, a, [s.t(D(L))], lambda x, a: comm.all_reduce(x[0], async_op=a)),
        "all_reduce_into": lambda s, a: _one(
            s, a, [s.t(D(L)), s.t(torch.zeros(L))], lambda x, a: comm.all_reduce_into(x[0], x[1], async_op=a)
        ),
        "all_gather_in_place": lambda s, a: _one(
            s, a, [s.t(torch.cat([D(9) if k == rank else torch.zeros(9) for k in range(n)]))],
            lambda x, a: comm.all_gather_in_place(x[0], async_op=a),
        ),
        "all_to_all_v": lambda s, a: _one(
            s, a, [s.t(D(sum(1 + rank + k for k in range(n)))), s.t(torch.zeros(sum(1 + k + rank for k in range(n))))],
            lambda x, a: comm.all_to_all_v(
                x[0], [1 + rank + k for k in range(n)], x[1], [1 + k + rank for k in range(n)], async_op=a
            ),
        ),
        "all_reduce_coalesced": lambda s, a: _one(
            s, a, [s.t(D(k * 100 + 1, salt=k)) for k in range(4)], lambda x, a: comm.all_reduce_coalesced(x, async_op=a)
        ),
    }
    from oxcomm import coalesced

    def rs_coalesced(s, a):
        values = [D(10 + 3 * k, salt=k) * n for k in range(3)]
        return [o.cpu() for o in coalesced.reduce_scatter_coalesced(comm, [s.t(v) for v in values])]

    ops["reduce_scatter_coalesced"] = rs_coalesced
    checked = []
    for name, fn in ops.items():
        for finish in ("sync", "wait", "synchronize", "future"):
            a = finish != "sync"
            want = fn(_Side(torch.device("cpu"), "wait"), a)
            side = _Side(device, finish)
            if cuda:
                with torch.cuda.stream(stream):
                    got = fn(side, a)
            else:
                got = fn(side, a)
            for g, w in zip(got, want):
                assert torch.equal(g, w), f"rank {rank}: Communicator.{name} {finish}"
            checked.append(f"{name} {finish}")
    dist.barrier()
    return checked


def _one(side, a, tensors, call):
    work = call(tensors, a)
    if a:
        if side.finish == "synchronize" and hasattr(work, "synchronize"):
            work.synchronize()
            assert work.is_completed()
        elif side.finish == "future":
            work.get_future().result(timeout=60)
            assert work.is_completed()
        else:
            work.wait()
    return side.read(tensors)


def _mlp(seed, device):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4)
    ).to(device)


def case_ddp():
    """DDP for 10 steps on CUDA through oxcomm and through gloo (CUDA tensors) from the same
    seed: equal parameters up to summation order, and equal on every rank. The default group's
    spec is ``OXCOMM_TEST_SPEC`` (``"oxcomm"``, or ``"cpu:gloo,cuda:oxcomm"``: CUDA tensors on
    oxcomm's Backend beside gloo's)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oxcomm.torch.process_group import python_backends_supported

    spec = os.environ.get("OXCOMM_TEST_SPEC", "oxcomm")
    if spec != "oxcomm" and not python_backends_supported():
        return {"unsupported": torch.__version__}
    dist = _init(spec)
    gl = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    device = _device()
    result = {}
    params = {}
    for name, group in (("oxcomm", None), ("gloo", gl)):
        model = DDP(_mlp(1234 + rank, device), process_group=group, bucket_cap_mb=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(99 + rank)
        for _ in range(10):
            x = torch.randn(16, 32, generator=gen).to(device)
            y = torch.randn(16, 4, generator=gen).to(device)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        params[name] = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    diff = (params["oxcomm"] - params["gloo"]).abs().max().item()
    assert torch.allclose(params["oxcomm"], params["gloo"], rtol=1e-5, atol=1e-5), diff
    ref = params["oxcomm"].clone()
    dist.broadcast(ref, src=0, group=gl)
    assert torch.equal(ref, params["oxcomm"]), "ranks disagree"
    result["max_diff"] = diff
    return result


# ------------------------------------------------------------------------------- in pytest


@pytest.mark.parametrize("world", [2, 3])
def test_torch_ops_on_cuda_match_cpu(world):
    res = _torch_ranks.run(world, "test_cuda_ops:case_torch_ops", timeout=300, env=RANKS_ENV)
    assert all(r == res[0] for r in res) and len(res[0]) > 100


@pytest.mark.parametrize("world", [2, 3])
def test_communicator_ops_on_cuda_match_cpu(world):
    res = _torch_ranks.run(world, "test_cuda_ops:case_communicator_ops", timeout=180, env=RANKS_ENV)
    assert all(r == res[0] for r in res)


@pytest.mark.parametrize("spec", ["oxcomm", "cpu:gloo,cuda:oxcomm"])
def test_ddp_on_cuda_matches_gloo(spec):
    res = _torch_ranks.run(2, "test_cuda_ops:case_ddp", timeout=180, env=dict(RANKS_ENV, OXCOMM_TEST_SPEC=spec))
    if "unsupported" in res[0]:
        pytest.skip(f"torch {res[0]['unsupported']} cannot host a Python backend beside gloo's")
    assert res[0]["max_diff"] < 1e-5
