"""The torch.distributed backend "oxcomm": every call a CPU training script makes, compared
with gloo in the same job, new_group (including groups that exclude a rank), object
collectives, and DDP (with comm hooks) against DDP on gloo from the same seed.

Each test spawns its ranks with ``_torch_ranks.run``: the ``case_*`` functions below run in
the ranks, ``test_*`` in pytest.
"""

from __future__ import annotations

import os

import pytest

import _torch_ranks

pytest.importorskip("torch")


# ------------------------------------------------------------------------------- in the ranks


def _init():
    import torch
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(os.environ.get("OXCOMM_TEST_DEFAULT", "oxcomm"))
    other = "gloo" if dist.get_backend() == "oxcomm" else "oxcomm"
    return dist.new_group(backend=other)


def _groups():
    """(oxcomm group, gloo group) in one world."""
    import torch.distributed as dist

    side = _init()
    if dist.get_backend() == "oxcomm":
        return None, side
    return side, None


def _data(dtype, n, rank, salt=0):
    import torch

    if dtype.is_floating_point:
        # Small integers in floats: every sum, product, min and max is exact in any order.
        return ((torch.arange(n, dtype=torch.float64) * 7 + rank * 3 + salt) % 5 - 2).to(dtype)
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 - 5).to(dtype)


def _same(name, got, want):
    import torch

    if isinstance(got, (list, tuple)):
        assert len(got) == len(want), f"{name}: {len(got)} vs {len(want)} tensors"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(f"{name}[{i}]", g, w)
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    assert torch.equal(got, want), f"{name}: oxcomm {got.flatten()[:8].tolist()} != gloo {want.flatten()[:8].tolist()}"


def case_collectives():
    """Each torch.distributed collective on oxcomm and on gloo, same inputs, exact equality."""
    import torch
    import torch.distributed as dist

    ox, gl = _groups()
    rank, n = dist.get_rank(), dist.get_world_size()
    checked = []

    def both(name, fn):
        """fn(group) -> tensor or list of tensors; compared exactly."""
        got = fn(ox)
        want = fn(gl)
        _same(name, got, want)
        checked.append(name)

    R = dist.ReduceOp
    float_dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    int_dtypes = [torch.int32, torch.int64, torch.uint8, torch.int8]
    for dtype in float_dtypes + int_dtypes:
        for size in (0, 1, 7, 1000):
            ops = [R.SUM, R.MIN, R.MAX]
            if size <= 7 and dtype != torch.uint8:
                ops.append(R.PRODUCT)
            if not dtype.is_floating_point:
                ops += [R.BAND, R.BOR, R.BXOR]
            for op in ops:

                def ar(g, dtype=dtype, size=size, op=op):
                    t = _data(dtype, size, rank)
                    dist.all_reduce(t, op=op, group=g)
                    return t

                both(f"all_reduce {op} {dtype} x{size}", ar)
    # AVG (gloo has none): oxcomm's against gloo's SUM / n, on values whose mean is exact.
    for dtype in (torch.float32, torch.float64):
        t = _data(dtype, 33, rank) * n
        s = t.clone()
        dist.all_reduce(t, op=R.AVG, group=ox)
        dist.all_reduce(s, op=R.SUM, group=gl)
        _same(f"all_reduce AVG {dtype}", t, s / n)
        checked.append(f"all_reduce AVG {dtype}")

    # async all_reduce: wait, is_completed, get_future().value()
    def ar_async(g):
        t = _data(torch.float32, 4099, rank)
        w = dist.all_reduce(t, group=g, async_op=True)
        fut = w.get_future()
        w.wait()
        assert w.is_completed()
        v = fut.wait()
        assert isinstance(v, list) and v[0] is not None
        return t

    both("all_reduce async + future", ar_async)

    def ar_noncontig(g):
        t = _data(torch.float32, 64, rank).view(8, 8).t()
        assert not t.is_contiguous()
        dist.all_reduce(t, group=g)
        return t.contiguous()

    both("all_reduce non-contiguous", ar_noncontig)

    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for size in (1, 5, 1024):

            def ag(g, dtype=dtype, size=size):
                out = [torch.zeros(size, dtype=dtype) for _ in range(n)]
                dist.all_gather(out, _data(dtype, size, rank), group=g)
                return out

            both(f"all_gather {dtype} x{size}", ag)

            def agt(g, dtype=dtype, size=size):
                out = torch.zeros(n * size, dtype=dtype)
                dist.all_gather_into_tensor(out, _data(dtype, size, rank), group=g)
                return out

            both(f"all_gather_into_tensor {dtype} x{size}", agt)

            def agt2(g, dtype=dtype, size=size):
                out = torch.zeros(n, size, dtype=dtype)
                dist.all_gather_into_tensor(out, _data(dtype, size, rank).view(1, size), group=g)
                return out

            both(f"all_gather_into_tensor stacked {dtype} x{size}", agt2)

            for op in (R.SUM, R.MAX):

                def rs(g, dtype=dtype, size=size, op=op):
                    out = torch.zeros(size, dtype=dtype)
                    ins = [_data(dtype, size, rank, salt=k) for k in range(n)]
                    dist.reduce_scatter(out, ins, op=op, group=g)
                    return out

                both(f"reduce_scatter {op} {dtype} x{size}", rs)

                def rst(g, dtype=dtype, size=size, op=op):
                    out = torch.zeros(size, dtype=dtype)
                    dist.reduce_scatter_tensor(out, _data(dtype, n * size, rank), op=op, group=g)
                    return out

                both(f"reduce_scatter_tensor {op} {dtype} x{size}", rst)

            def a2a(g, dtype=dtype, size=size):
                ins = [_data(dtype, size, rank, salt=k) for k in range(n)]
                out = [torch.zeros(size, dtype=dtype) for _ in range(n)]
                try:
                    dist.all_to_all(out, ins, group=g)
                except RuntimeError as e:
                    if g is not gl or "does not support alltoall" not in str(e):
                        raise
                    # an older torch's gloo (2.11) has only the single-tensor form: the reference through it
                    flat = torch.zeros(n * size, dtype=dtype)
                    dist.all_to_all_single(flat, torch.cat(ins), group=g)
                    return list(flat.split(size)) if size else out
                return out

            both(f"all_to_all {dtype} x{size}", a2a)

            def a2as(g, dtype=dtype, size=size):
                out = torch.zeros(n * size, dtype=dtype)
                dist.all_to_all_single(out, _data(dtype, n * size, rank), group=g)
                return out

            both(f"all_to_all_single {dtype} x{size}", a2as)

            for root in range(n):

                def bc(g, dtype=dtype, size=size, root=root):
                    t = _data(dtype, size, rank)
                    dist.broadcast(t, src=root, group=g)
                    return t

                both(f"broadcast root {root} {dtype} x{size}", bc)

                def rd(g, dtype=dtype, size=size, root=root):
                    t = _data(dtype, size, rank)
                    dist.reduce(t, dst=root, group=g)
                    return t if rank == root else torch.zeros(0)

                both(f"reduce root {root} {dtype} x{size}", rd)

                def ga(g, dtype=dtype, size=size, root=root):
                    out = [torch.zeros(size, dtype=dtype) for _ in range(n)] if rank == root else None
                    dist.gather(_data(dtype, size, rank), out, dst=root, group=g)
                    return out if rank == root else []

                both(f"gather root {root} {dtype} x{size}", ga)

                def sc(g, dtype=dtype, size=size, root=root):
                    out = torch.zeros(size, dtype=dtype)
                    ins = [_data(dtype, size, rank, salt=k) for k in range(n)] if rank == root else None
                    dist.scatter(out, ins, src=root, group=g)
                    return out

                both(f"scatter root {root} {dtype} x{size}", sc)

    # all_to_all with uneven sizes (gloo refuses them: checked against what each peer sent),
    # and all_to_all_single with split sizes (both).
    ins = [_data(torch.float32, 1 + rank + 2 * k, rank, salt=k) for k in range(n)]
    out = [torch.zeros(1 + k + 2 * rank) for k in range(n)]
    dist.all_to_all(out, ins, group=ox)
    _same("all_to_all uneven", out, [_data(torch.float32, 1 + k + 2 * rank, k, salt=rank) for k in range(n)])
    checked.append("all_to_all uneven")

    def a2as_split(g):
        in_splits = [1 + rank + k for k in range(n)]
        out_splits = [1 + k + rank for k in range(n)]
        inp = _data(torch.float32, sum(in_splits) * 3, rank).view(-1, 3)
        out = torch.zeros(sum(out_splits), 3)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=g)
        return out

    both("all_to_all_single split sizes", a2as_split)

    # point to point: a ring of send/recv, isend/irecv and batch_isend_irecv.
    def p2p(g, kind):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = torch.zeros(37)
        mine = _data(torch.float32, 37, rank)
        if kind == "blocking":
            if rank % 2 == 0:
                dist.send(mine, dst=right, group=g)
                dist.recv(out, src=left, group=g)
            else:
                dist.recv(out, src=left, group=g)
                dist.send(mine, dst=right, group=g)
        elif kind == "async":
            reqs = [dist.isend(mine, dst=right, group=g), dist.irecv(out, src=left, group=g)]
            for r in reqs:
                r.wait()
        else:
            ops = [dist.P2POp(dist.isend, mine, right, g), dist.P2POp(dist.irecv, out, left, g)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
        return out

    if n > 1:
        for kind in ("blocking", "async", "batch"):
            both(f"p2p {kind}", lambda g, kind=kind: p2p(g, kind))

    dist.barrier()
    dist.barrier(group=gl)
    checked.append("barrier")
    from datetime import timedelta

    try:
        dist.monitored_barrier(group=ox, timeout=timedelta(seconds=30))
        checked.append("monitored_barrier")
    except ValueError as e:
        # torch before 2.15 (2.11 checked) refuses monitored_barrier on any backend but gloo,
        # before it reaches the backend
        if "only implemented for GLOO" not in str(e):
            raise
        import oxcomm.torch

        oxcomm.torch.communicator(ox).monitored_barrier(30.0)  # what the backend runs for it on 2.15
        checked.append("monitored_barrier (the communicator's)")

    # object collectives
    def objs(g):
        got = [None] * n
        dist.all_gather_object(got, {"rank": rank, "x": list(range(rank + 1))}, group=g)
        lst = [f"hello from {rank}", rank * 10] if rank == 0 else [None, None]
        dist.broadcast_object_list(lst, src=0, group=g)
        gathered = [None] * n if rank == n - 1 else None
        dist.gather_object(("g", rank), gathered, dst=n - 1, group=g)
        out = [None]
        dist.scatter_object_list(out, [("s", k) for k in range(n)] if rank == 0 else None, src=0, group=g)
        return [got, lst, gathered, out]

    a, b = objs(ox), objs(gl)
    assert a == b, f"object collectives: {a} != {b}"
    checked.append("object collectives")
    if n > 1:
        if rank == 0:
            dist.send_object_list([{"k": 1}], dst=1, group=ox)
        elif rank == 1:
            box = [None]
            dist.recv_object_list(box, src=0, group=ox)
            assert box == [{"k": 1}], box
        checked.append("send_object_list")

    # a receive from any source: the last rank sends, rank 0 learns who
    if n > 1:
        if rank == 0:
            got = torch.zeros(1)
            assert dist.recv(got, group=ox) == n - 1 and got.item() == n - 1, got
        elif rank == n - 1:
            dist.send(torch.full((1,), float(rank)), 0, group=ox)
        checked.append("recv from any source")
    # PREMUL_SUM as NCCL: sum over ranks of factor * input (refused, naming it, on a torch
    # that hides the factor)
    x = torch.full((3,), float(rank + 1))
    if _torch_ranks.premul_sum_exposed():
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0), group=ox)
        assert torch.equal(x, torch.full((3,), float(n * (n + 1)))), x
    else:
        _torch_ranks.refuses_premul_sum(lambda: dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0), group=ox))
    checked.append("PREMUL_SUM")
    dist.barrier()
    return checked


def case_groups():
    """new_group over a subset that excludes a rank, on a 3-rank world, next to gloo's."""
    import torch
    import torch.distributed as dist

    _init()
    rank, n = dist.get_rank(), dist.get_world_size()
    assert n == 3
    members = [0, 2]
    ox = dist.new_group(members, backend="oxcomm")
    gl = dist.new_group(members, backend="gloo")
    pair = dist.new_group([1, 2], backend="oxcomm")
    out = {}
    if rank in members:
        assert dist.get_world_size(ox) == 2 and dist.get_rank(ox) == members.index(rank)
        a = torch.arange(10, dtype=torch.float32) + rank
        b = a.clone()
        dist.all_reduce(a, group=ox)
        dist.all_reduce(b, group=gl)
        assert torch.equal(a, b), (a, b)
        t = torch.full((4,), float(rank))
        dist.broadcast(t, src=2, group=ox)  # global rank 2
        assert torch.equal(t, torch.full((4,), 2.0)), t
        got = [None, None]
        dist.all_gather_object(got, rank, group=ox)
        assert got == members, got
        out["sum"] = a.tolist()
    else:
        assert ox == dist.GroupMember.NON_GROUP_MEMBER
        out["excluded"] = True
    if rank in (1, 2):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pair)
        assert t.item() == 3.0, t
    dist.barrier()
    return out


def case_recv_any_source():
    """``dist.recv``/``dist.irecv`` without ``src`` on oxcomm and on gloo in one job: rank 0
    takes every message as it comes; ``recv`` returns the sender's global rank, an ``irecv``'s
    Work names it; on a group, only its members' messages are candidates."""
    import torch
    import torch.distributed as dist

    _init()
    rank, n = dist.get_rank(), dist.get_world_size()
    assert n == 3
    sub = {"oxcomm": dist.new_group([0, 2], backend="oxcomm"), "gloo": dist.new_group([0, 2], backend="gloo")}
    out = {}
    for name in ("oxcomm", "gloo"):
        g = None if dist.get_backend() == name else dist.new_group(backend=name)
        if rank == 0:
            got = []
            for _ in range(2 * (n - 1)):
                t = torch.zeros(4)
                src = dist.recv(t, group=g)
                assert torch.equal(t, torch.full((4,), float(src))), (name, src, t)
                got.append(src)
            t = torch.zeros(4)
            w = dist.irecv(t, group=g)
            w.wait()
            src = w._source_rank()
            assert torch.equal(t, torch.full((4,), float(src))), (name, src, t)
            got.append(src)
            # On the group [0, 2]: global rank 2's message (rank 1 sends on the world).
            t = torch.zeros(2)
            src = dist.recv(t, group=sub[name])
            assert src == 2 and torch.equal(t, torch.full((2,), 2.0)), (name, src, t)
            late = torch.zeros(2)
            assert dist.recv(late, src=1, group=g, tag=1) == 1
            out[name] = sorted(got)
        else:
            for _ in range(2 + (rank == 1)):
                dist.send(torch.full((4,), float(rank)), 0, group=g)
            if rank == 1:
                # another tag: a receive from any source of tag 0 must not take it
                dist.send(torch.full((2,), 1.0), 0, group=g, tag=1)
            else:
                dist.send(torch.full((2,), 2.0), 0, group=sub[name])
        dist.barrier()
    return out


def case_sparse_all_reduce():
    """A sparse COO all-reduce (SUM) on oxcomm and on gloo in one job: each rank a different
    number of nonzeros (rank 2 none), overlapping indices, rows of dense values; equal to
    gloo's and to the dense sum. Another op than SUM is refused naming the call."""
    import torch
    import torch.distributed as dist

    _init()
    rank = dist.get_rank()
    results = {}
    for name in ("oxcomm", "gloo"):
        g = None if dist.get_backend() == name else dist.new_group(backend=name)
        nnz = [3, 5, 0][rank]
        idx = torch.tensor([[(k * 3 + rank) % 7 for k in range(nnz)]], dtype=torch.int64)
        val = torch.arange(nnz * 2, dtype=torch.float32).reshape(nnz, 2) + rank
        t = torch.sparse_coo_tensor(idx, val, (7, 2))
        dense = t.to_dense()
        dist.all_reduce(t, group=g)
        dist.all_reduce(dense, group=g)
        assert torch.equal(t.to_dense(), dense), (name, t.to_dense(), dense)
        results[name] = dense.tolist()
    assert results["oxcomm"] == results["gloo"]
    ox = None if dist.get_backend() == "oxcomm" else dist.new_group(backend="oxcomm")
    try:
        dist.all_reduce(torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), [], (3,)), dist.ReduceOp.MAX, group=ox)
        raise AssertionError("MAX of a sparse tensor was not refused")
    except NotImplementedError as e:
        assert "SUM only" in str(e), e
    return results["oxcomm"]


def case_gloo_default():
    """init_process_group("gloo"), then an oxcomm group of the whole world beside it."""
    import torch
    import torch.distributed as dist

    os.environ["OXCOMM_TEST_DEFAULT"] = "gloo"
    ox = _init()
    assert dist.get_backend() == "gloo" and dist.get_backend(ox) == "oxcomm"
    t = torch.arange(5, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=ox)
    return t.tolist()


def _mlp(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    )


def _train_ddp(group, hook, steps=20):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = DDP(_mlp(1234 + rank), process_group=group, bucket_cap_mb=0.01)  # rank-dependent init: DDP syncs it
    if hook is not None:
        model.register_comm_hook(group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(99 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def case_ddp():
    """DDP for 20 steps on oxcomm and on gloo from the same seed: equal parameters (up to
    summation order), with the default all-reduce and with torch's comm hooks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ox, gl = _groups()
    report = {}
    for name, hook in (
        ("default", None),
        ("allreduce_hook", default_hooks.allreduce_hook),
        ("fp16_compress_hook", default_hooks.fp16_compress_hook),
    ):
        a = _train_ddp(ox, hook)
        b = _train_ddp(gl, hook)
        diff = (a - b).abs().max().item()
        tol = 1e-5 if hook is not default_hooks.fp16_compress_hook else 1e-3
        assert torch.allclose(a, b, rtol=tol, atol=tol), f"DDP {name}: max |oxcomm - gloo| = {diff}"
        # every rank holds the same parameters
        ref = a.clone()
        dist.broadcast(ref, src=0, group=gl)
        assert torch.equal(a, ref), f"DDP {name}: ranks disagree"
        report[name] = diff
    return report


def case_rank_killed():
    """Rank 1 is SIGKILLed while rank 0 waits in all_reduce (blocking, then async through a
    future): rank 0 raises within 2 s, naming rank 1, and does not hang."""
    import signal
    import time

    import torch
    import torch.distributed as dist

    _init()
    rank = dist.get_rank()
    t = torch.ones(1 << 20)
    dist.all_reduce(t)  # the links are up
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
        raise AssertionError("all_reduce with a dead peer returned")
    except RuntimeError as e:
        took = time.monotonic() - start - 0.5
        msg = str(e)
    assert took < 2.0, f"took {took:.2f} s after the kill"
    assert "1" in msg and ("rank" in msg or "peer" in msg), msg
    return {"seconds": round(took, 3), "error": msg[:300]}


def case_mismatch():
    """Ranks pass different sizes to all_reduce: every rank raises (no hang, no wrong answer)."""
    import torch
    import torch.distributed as dist

    _init()
    rank = dist.get_rank()
    t = torch.ones(10 + rank)
    try:
        dist.all_reduce(t)
        raise AssertionError("mismatched all_reduce returned")
    except RuntimeError as e:
        return str(e)[:300]


# ------------------------------------------------------------------------------- in pytest


def test_rank_killed_mid_op_raises_within_2s():
    res = _torch_ranks.run(2, "test_torch_backend:case_rank_killed", timeout=60, may_die={1})
    assert res[1] is None and res[0]["seconds"] < 2.0, res


def test_mismatched_sizes_raise_on_every_rank():
    res = _torch_ranks.run(2, "test_torch_backend:case_mismatch", timeout=60)
    assert all(res), res


def test_collectives_match_gloo_2_ranks():
    res = _torch_ranks.run(2, "test_torch_backend:case_collectives", timeout=240)
    assert len(res[0]) > 100 and res[0] == res[1]


def test_collectives_match_gloo_3_ranks():
    res = _torch_ranks.run(3, "test_torch_backend:case_collectives", timeout=360)
    assert res[0] == res[1] == res[2]


def test_collectives_one_rank():
    res = _torch_ranks.run(1, "test_torch_backend:case_collectives", timeout=120)
    assert "barrier" in res[0]


def test_new_group_excluding_a_rank():
    res = _torch_ranks.run(3, "test_torch_backend:case_groups", timeout=120)
    assert res[1] == {"excluded": True}
    assert res[0]["sum"] == res[2]["sum"] == [2.0 + 2 * k for k in range(10)]


def test_recv_from_any_source_as_gloo():
    res = _torch_ranks.run(3, "test_torch_backend:case_recv_any_source", timeout=120)
    assert res[0]["oxcomm"] == res[0]["gloo"] == [1, 1, 1, 2, 2], res[0]


def test_sparse_all_reduce_as_gloo():
    res = _torch_ranks.run(3, "test_torch_backend:case_sparse_all_reduce", timeout=120)
    assert res[0] == res[1] == res[2] and any(v != 0 for row in res[0] for v in row)


def test_oxcomm_group_beside_gloo_default():
    res = _torch_ranks.run(2, "test_torch_backend:case_gloo_default", timeout=120)
    assert res[0] == res[1] == [3.0 * k for k in range(5)]


def test_ddp_matches_gloo():
    res = _torch_ranks.run(2, "test_torch_backend:case_ddp", timeout=240)
    assert set(res[0]) == {"default", "allreduce_hook", "fp16_compress_hook"}


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DDP_EXAMPLE = os.path.join(REPO, "crates", "oxcomm-py", "examples", "ddp_train.py")


def _oxcomm_binary():
    """The oxcomm CLI: $OXCOMM, else the workspace's build (built here if missing)."""
    import subprocess

    if os.environ.get("OXCOMM"):
        return os.environ["OXCOMM"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    for profile in ("release", "debug"):
        path = os.path.join(target, profile, "oxcomm")
        if os.path.exists(path):
            return path
    subprocess.run(["cargo", "build", "-q", "-p", "oxcomm-cli"], cwd=REPO, check=True, timeout=1800)
    return os.path.join(target, "debug", "oxcomm")


def _run_example(cmd, timeout=240):
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [c if c != "python3" else sys.executable for c in cmd],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _torch_ranks._kill(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} timed out\n{out.decode(errors='replace')[-4000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    return text


def _final_loss(text):
    import re

    m = re.search(r"loss after \d+ steps ([0-9.]+)", text)
    assert m, text[-3000:]
    return float(m.group(1))


def test_unchanged_script_on_oxcomm_and_gloo_under_torchrun():
    """The same DDP script under torchrun on "gloo" and on "oxcomm": the same loss."""
    import sys

    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", DDP_EXAMPLE]
    ox = _final_loss(_run_example(run + ["--backend", "oxcomm", "--steps", "30"]))
    gl = _final_loss(_run_example(run + ["--backend", "gloo", "--steps", "30"]))
    assert abs(ox - gl) <= 1e-4 * max(1.0, gl), (ox, gl)


def test_script_under_oxcomm_launch():
    """init_process_group("oxcomm") under `oxcomm launch` (whose store is oxcomm's, not torch's)."""
    text = _run_example([_oxcomm_binary(), "launch", "-n", "2", "--", "python3", DDP_EXAMPLE, "--steps", "10"])
    assert "oxcomm: loss after 10 steps" in text, text[-3000:]
