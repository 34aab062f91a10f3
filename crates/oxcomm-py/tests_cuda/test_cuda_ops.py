"""Every op of the ``"oxcomm"`` torch backend and of ``oxcomm.Communicator`` on device tensors,
2 and 3 ranks (sharing ``cuda:0`` on a GPU), against the same op on host tensors, exactly: sync
and async (completed by ``wait``, ``synchronize``, a future), tensors below and above the
shared-memory ring (1 MiB), several dtypes and mixed dtypes in coalesced calls, on a
non-default current stream with each input written by a late kernel and each output read right
after the op; DDP with comm hooks against gloo's; and the regression tests of the staging path's
defects (issue 37). On a machine without CUDA the device is the fake one (``conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from _sides import Cases, Side, check, data
from conftest import on_cuda, run

from _on_device import target

torch = pytest.importorskip("torch")

#: Elements of the tests' large tensors: above the shared-memory ring (1 MiB) in every dtype used,
#: and an odd count (the last part of a chunked op is short).
BIG = (3 << 18) + 5
#: The exchange that deadlocked (defect 1): 4 MiB of float32 each way.
RING_EXCHANGE = 1 << 20


def _init(spec="oxcomm", timeout=None):
    from datetime import timedelta

    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    target()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    dist.init_process_group(spec, **kw)
    return dist


# ------------------------------------------------------------------------------- torch.distributed


def _torch_cases(dist, rank, n, dtype, big):
    """name -> fn(side, async) -> tensors to compare, through torch.distributed's functions.
    ``big``: the cases whose tensors are above the ring (float32 only: see the caller)."""
    R = dist.ReduceOp
    D = lambda k, salt=0: data(dtype, k, rank, salt)  # noqa: E731
    Z = lambda k: torch.zeros(k, dtype=dtype)  # noqa: E731
    L = BIG if big else 1001
    cases = Cases()
    case = cases.case

    @case(f"all_reduce {L}")
    def _(s, a):
        x = s.t(D(L))
        s.done(dist.all_reduce(x, async_op=a))
        return [x]

    @case(f"all_gather_into_tensor {L}")
    def _(s, a):
        out = s.t(Z(n * L))
        s.done(dist.all_gather_into_tensor(out, s.t(D(L)), async_op=a))
        return [out]

    @case(f"reduce_scatter_tensor {L}")
    def _(s, a):
        out = s.t(Z(L))
        s.done(dist.reduce_scatter_tensor(out, s.t(D(L * n)), async_op=a))
        return [out]

    @case(f"isend/irecv ring {L}")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = s.t(Z(L))
        works = [dist.isend(s.t(D(L)), dst=right), dist.irecv(out, src=left)]
        for w in works:
            s.done(w)
        return [out]

    @case(f"batch_isend_irecv {L}")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = s.t(Z(L))
        ops = [dist.P2POp(dist.isend, s.t(D(L)), right), dist.P2POp(dist.irecv, out, left)]
        for w in dist.batch_isend_irecv(ops):
            s.done(w)
        return [out]

    for root in range(n):

        @case(f"broadcast {root} {L}")
        def _(s, a, root=root):
            x = s.t(D(L))
            s.done(dist.broadcast(x, src=root, async_op=a))
            return [x]

        @case(f"reduce {root} {L}")
        def _(s, a, root=root):
            x = s.t(D(L))
            s.done(dist.reduce(x, dst=root, async_op=a))
            return [x] if rank == root else []

    if big:
        return cases

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

    @case("all_gather (scratch)")
    def _(s, a):
        outs = [s.t(Z(100)) for _ in range(n)]
        s.done(dist.all_gather(outs, s.t(D(100)), async_op=a))
        return outs

    @case("reduce_scatter")
    def _(s, a):
        out = s.t(Z(50))
        s.done(dist.reduce_scatter(out, [s.t(D(50, salt=k)) for k in range(n)], async_op=a))
        return [out]

    @case("all_to_all (scratch)")
    def _(s, a):
        outs = [s.t(Z(33)) for _ in range(n)]
        s.done(dist.all_to_all(outs, [s.t(D(33, salt=k)) for k in range(n)], async_op=a))
        return outs

    @case("all_to_all_single split sizes")
    def _(s, a):
        ins = [1 + rank + k for k in range(n)]
        outs = [1 + k + rank for k in range(n)]
        out = s.t(torch.zeros(sum(outs), 3, dtype=dtype))
        s.done(dist.all_to_all_single(out, s.t(D(sum(ins) * 3)).view(-1, 3), outs, ins, async_op=a))
        return [out]

    @case("send/recv ring (non-contiguous recv)")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = s.t(torch.zeros(6, 6, dtype=dtype)).t()
        works = [dist.isend(s.t(D(36)), dst=right), dist.irecv(out, src=left)]
        for w in works:
            s.done(w)
        return [out.contiguous()]

    @case("recv from any source")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        out = s.t(Z(40))
        if rank % 2 == 0:
            dist.send(s.t(D(40)), dst=right)
            src = dist.recv(out)
        else:
            src = dist.recv(out)
            dist.send(s.t(D(40)), dst=right)
        assert src == left, (src, left)
        return [out]

    for root in range(n):

        @case(f"gather {root} (scratch)")
        def _(s, a, root=root):
            outs = [s.t(Z(77)) for _ in range(n)] if rank == root else None
            s.done(dist.gather(s.t(D(77)), outs, dst=root, async_op=a))
            return outs or []

        @case(f"scatter {root}")
        def _(s, a, root=root):
            out = s.t(Z(77))
            ins = [s.t(D(77, salt=k)) for k in range(n)] if rank == root else None
            s.done(dist.scatter(out, ins, src=root, async_op=a))
            return [out]

    return cases


def case_torch_ops():
    """Every torch.distributed call on the device against the same call on host tensors, on the
    oxcomm default group: float32, bfloat16 and int64 below the ring, float32 above it."""
    dist = _init()
    rank, n = dist.get_rank(), dist.get_world_size()
    checked = []
    # (bfloat16 on CUDA only: on the fake device its staging is float32's with another item size)
    dtypes = (torch.float32, torch.bfloat16, torch.int64) if on_cuda() else (torch.float32, torch.int64)
    for dtype in dtypes:
        checked += check(_torch_cases(dist, rank, n, dtype, False), ("sync", "wait", "future"), label=f"{dtype} ")
    checked += check(_torch_cases(dist, rank, n, torch.float32, True), ("sync", "wait", "future"), label="big ")
    # a device tensor and a host tensor in one call: a named error
    tg = target()
    with tg.on(tg.stream()):
        try:
            dist.all_gather_into_tensor(_as_host(torch.zeros(n)), tg.tensor(torch.zeros(1)))
            raise AssertionError("mixed devices: no error")
        except ValueError as e:
            assert "all_gather_into_tensor" in str(e), e
    checked.append("mixed devices refused")
    got = [None] * n
    dist.all_gather_object(got, {"rank": rank})
    assert got == [{"rank": r} for r in range(n)], got
    dist.barrier()
    tg.check()
    checked.append("objects and barrier")
    return checked


# ------------------------------------------------------------------------------- Communicator


def _communicator_cases(comm, dtype, big):
    """name -> fn(side, async) returning the tensors to compare, through oxcomm.Communicator."""
    rank, n = comm.rank, comm.size
    D = lambda k, salt=0: data(dtype, k, rank, salt)  # noqa: E731
    Z = lambda k: torch.zeros(k, dtype=dtype)  # noqa: E731
    cases = Cases()
    case = cases.case

    L = BIG if big else 37
    tag = " big" if big else ""

    @case("all_reduce" + tag)
    def _(s, a):
        x = s.t(D(L))
        s.done(comm.all_reduce(x, async_op=a))
        return [x]

    @case("all_reduce_into" + tag)
    def _(s, a):
        x, y = s.t(D(L)), s.t(Z(L))
        s.done(comm.all_reduce_into(x, y, async_op=a))
        return [x, y]

    @case("send/recv ring" + tag)
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        x, y = s.t(D(L)), s.t(Z(L))
        if a:
            for w in [comm.isend(x, right), comm.irecv(y, left)]:
                s.done(w)
        elif rank % 2 == 0:
            comm.send(x, right)
            comm.recv(y, left)
        else:
            comm.recv(y, left)
            comm.send(x, right)
        return [y]

    if big:

        @case("all_gather big")
        def _(s, a):
            x, y = s.t(D(L)), s.t(Z(L * n))
            s.done(comm.all_gather(x, y, async_op=a))
            return [y]

        return cases

    @case("all_reduce max, empty")
    def _(s, a):
        x, e = s.t(D(L)), s.t(D(0))
        s.done(comm.all_reduce(x, "max", async_op=a))
        s.done(comm.all_reduce(e, async_op=a))
        return [x, e]

    for root in range(n):

        @case(f"reduce root {root}")
        def _(s, a, root=root):
            x = s.t(D(L))
            s.done(comm.reduce(x, root, async_op=a))
            return [x]

        @case(f"reduce_into root {root}")
        def _(s, a, root=root):
            x = s.t(D(L))
            y = s.t(Z(L)) if rank == root else None
            s.done(comm.reduce_into(x, y, root, async_op=a))
            return [x] + ([y] if y is not None else [])

        @case(f"broadcast root {root}")
        def _(s, a, root=root):
            x = s.t(D(L))
            s.done(comm.broadcast(x, root, async_op=a))
            return [x]

        @case(f"gather root {root}")
        def _(s, a, root=root):
            x = s.t(D(5))
            y = s.t(Z(5 * n)) if rank == root else None
            s.done(comm.gather(x, y, root, async_op=a))
            return [x] + ([y] if y is not None else [])

        @case(f"gather_in_place root {root}")
        def _(s, a, root=root):
            x = s.t(D(5 * n) if rank == root else D(5))
            s.done(comm.gather_in_place(x, root, async_op=a))
            return [x]

        @case(f"scatter root {root}")
        def _(s, a, root=root):
            x = s.t(D(5 * n)) if rank == root else None
            y = s.t(Z(5))
            s.done(comm.scatter(x, y, root, async_op=a))
            return [y]

        @case(f"scatter_in_place root {root}")
        def _(s, a, root=root):
            x = s.t(D(5 * n) if rank == root else Z(5))
            s.done(comm.scatter_in_place(x, root, async_op=a))
            return [x]

    @case("all_gather")
    def _(s, a):
        x, y = s.t(D(7)), s.t(Z(7 * n))
        s.done(comm.all_gather(x, y, async_op=a))
        return [x, y]

    @case("all_gather, input a block of the output")
    def _(s, a):
        y = s.t(torch.cat([D(7) if k == rank else Z(7) for k in range(n)]))
        s.done(comm.all_gather(y[7 * rank : 7 * rank + 7], y, async_op=a))
        return [y]

    @case("all_gather_in_place")
    def _(s, a):
        y = s.t(torch.cat([D(7) if k == rank else Z(7) for k in range(n)]))
        s.done(comm.all_gather_in_place(y, async_op=a))
        return [y]

    @case("reduce_scatter")
    def _(s, a):
        x, y = s.t(D(6 * n)), s.t(Z(6))
        s.done(comm.reduce_scatter(x, y, async_op=a))
        return [x, y]

    @case("reduce_scatter_in_place")
    def _(s, a):
        x = s.t(D(6 * n))
        s.done(comm.reduce_scatter_in_place(x, async_op=a))
        return [x[6 * rank : 6 * rank + 6]]

    @case("all_to_all")
    def _(s, a):
        x, y = s.t(D(3 * n)), s.t(Z(3 * n))
        s.done(comm.all_to_all(x, y, async_op=a))
        return [x, y]

    @case("all_to_all, send is recv")
    def _(s, a):
        x = s.t(D(3 * n))
        s.done(comm.all_to_all(x, x, async_op=a))
        return [x]

    @case("all_to_all_v")
    def _(s, a):
        sc = [1 + rank + k for k in range(n)]
        rc = [1 + k + rank for k in range(n)]
        x, y = s.t(D(sum(sc))), s.t(Z(sum(rc)))
        s.done(comm.all_to_all_v(x, sc, y, rc, async_op=a))
        return [y]

    @case("all_reduce_coalesced")
    def _(s, a):
        xs = [s.t(D(k * 9 + 1, salt=k)) for k in range(3)]
        s.done(comm.all_reduce_coalesced(xs, async_op=a))
        return xs

    @case("all_gather_coalesced")
    def _(s, a):
        xs = [s.t(D(k + 2, salt=k)) for k in range(3)]
        ys = [s.t(Z((k + 2) * n)) for k in range(3)]
        s.done(comm.all_gather_coalesced(xs, ys, async_op=a))
        return ys

    @case("send/recv from any source")
    def _(s, a):
        right, left = (rank + 1) % n, (rank - 1) % n
        x, y = s.t(D(L)), s.t(Z(L))
        if a:
            recv = comm.irecv(y, None)
            s.done(comm.isend(x, right))
            s.done(recv)
            src = recv.source_rank()
        elif rank % 2 == 0:
            comm.send(x, right)
            src = comm.recv(y, None)
        else:
            src = comm.recv(y, None)
            comm.send(x, right)
        assert src == left, (src, left)
        return [y]

    @case("barrier")
    def _(s, a):
        s.done(comm.barrier(async_op=a))
        return []

    return cases


def case_communicator_ops():
    """oxcomm.Communicator's own ops on device tensors against host tensors: float32 and int64
    below the ring, float32 above it; many async ops in flight at once, host ops queued between
    them; the pinned pool stops growing; errors naming the op."""
    import oxcomm.torch

    dist = _init()
    comm = oxcomm.torch.communicator()
    rank = comm.rank
    tg = target()
    checked = []
    for dtype in (torch.float32, torch.int64):
        checked += check(_communicator_cases(comm, dtype, False), label=f"{dtype} ")
    checked += check(_communicator_cases(comm, torch.float32, True), label="big ")
    stream = tg.stream()
    # many async ops in flight at once, host ops queued between them, then one wait each
    with tg.on(stream):
        xs = [tg.tensor(data(torch.float32, 50 + k, rank, salt=k)) for k in range(6)]
        with tg.reference():
            hs = [data(torch.float32, 50 + k, rank, salt=k) for k in range(6)]
        hosts = [_as_host(h) for h in hs]
        works = []
        for x, h in zip(xs, hosts):
            works.append(comm.all_reduce(x, async_op=True))
            works.append(comm.all_reduce(h, async_op=True))  # a host op behind a device op
        for w in works:
            w.wait()
        for x, h in zip(xs, hosts):
            assert torch.equal(tg.host(x), h), "queued async ops: device and host results differ"
    checked.append("queued async ops")
    # the pool stopped growing: a second round of the same ops allocates nothing
    before = comm._st.pool.allocated
    with tg.on(stream):
        for fn in _communicator_cases(comm, torch.float32, False).values():
            fn(Side(False, "wait"), True)
        tg.synchronize()
    assert comm._st.pool.allocated == before, (before, comm._st.pool.allocated)
    checked.append("pool reused")
    # mixed devices and bad tensors: errors naming the op
    x = tg.tensor(torch.zeros(4))
    for call, needle in (
        (lambda: comm.all_reduce_into(x, _as_host(torch.zeros(4))), "all_reduce_into"),
        (lambda: comm.all_gather(x, _as_host(torch.zeros(4 * comm.size))), "all_gather"),
        (lambda: comm.all_reduce(tg.tensor(torch.zeros(4, 4)).t()), "not contiguous"),
        (lambda: comm.all_reduce(tg.tensor(torch.zeros(4)).to(torch.complex32)), "complex32"),
    ):
        try:
            call()
            raise AssertionError(f"{needle}: no error")
        except (ValueError, TypeError) as e:
            assert needle in str(e), e
    checked.append("errors")
    # DeepSpeed's coalesced reduce-scatters: device inputs, results on the inputs' device
    from oxcomm import coalesced

    with tg.on(stream):
        values = [data(torch.float32, 10 + 3 * k, rank, salt=k) * comm.size for k in range(3)]
        got = [tg.host(g) for g in coalesced.reduce_scatter_coalesced(comm, [tg.tensor(v) for v in values])]
    with tg.reference():
        want = coalesced.reduce_scatter_coalesced(comm, [v.clone() for v in values])
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "reduce_scatter_coalesced"
    checked.append("reduce_scatter_coalesced")
    dist.barrier()
    tg.check()
    return checked


def _as_host(t):
    """``t`` as host memory (pinned on CUDA; registered as host on the fake device)."""
    return t.pin_memory() if on_cuda() else target().fake.host(t.clone())


# ------------------------------------------------------------------------------- DDP


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    )


def _train(dist, model, group, hook, device, steps=6):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    net = DDP(model, process_group=group, bucket_cap_mb=0.01)
    if hook is not None:
        net.register_comm_hook(None, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(99 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 4, generator=gen)
        if device is not None:
            x, y = target().tensor(x), target().tensor(y)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def _then_hook(state, bucket):
    """A comm hook whose mean is a then-callback on the all-reduce's future (DDP's own hooks'
    shape): the callback runs where the future completes, on the device's terms."""
    import torch.distributed as dist

    n = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(n))


def case_ddp():
    """DDP on the device through oxcomm (the built-in all-reduce, a then-callback hook, torch's
    ``allreduce_hook``) against DDP through gloo on host tensors, from the same seed, on a
    non-default current stream: equal parameters up to summation order, equal on every rank.
    The default group's spec is ``OXCOMM_TEST_SPEC``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from oxcomm.torch.process_group import python_backends_supported

    spec = os.environ.get("OXCOMM_TEST_SPEC", "oxcomm")
    if spec != "oxcomm" and not python_backends_supported():
        return {"unsupported": torch.__version__}
    dist = _init(spec)
    tg = target()
    rank = dist.get_rank()
    gl = dist.new_group(backend="gloo")
    with tg.reference():
        want = torch.cat([p.flatten() for p in _train(dist, _mlp(1234), gl, None, None)])
    result = {}
    def allreduce_hook(state, bucket):
        return default_hooks.allreduce_hook(None, bucket)

    hooks = {"built-in": None, "then-callback": _then_hook, "allreduce_hook": allreduce_hook}
    stream = tg.stream()
    for name, hook in hooks.items():
        model = _mlp(1234)
        if tg.kind == "cuda":
            model = model.to(tg.device)
        with tg.on(stream):
            params = _train(dist, model, None, hook, tg.device)
            got = torch.cat([tg.host(p).flatten() for p in params])
        diff = (got - want).abs().max().item()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (name, diff)
        with tg.reference():
            ref = got.clone()
            dist.broadcast(ref, src=0, group=gl)
        assert torch.equal(ref, got), f"{name}: ranks disagree"
        result[name] = diff
    tg.check()
    return result


# ------------------------------------------------------------------------------- issue 37's defects


def case_issue37_isend_before_irecv_above_the_ring():
    """Defect 1: every rank isends 4 MiB to its right neighbour, then irecvs from its left, and
    waits on the isend first; through the Communicator and through torch.distributed, on device
    and on host tensors, and on host tensors queued on the lane behind a device op. The isend
    must not start alone (it would block until the timeout)."""
    import torch.distributed as dist

    import oxcomm.torch

    _init(timeout=40)
    comm = oxcomm.torch.communicator()
    tg = target()
    rank, n = comm.rank, comm.size
    right, left = (rank + 1) % n, (rank - 1) % n
    want = data(torch.float32, RING_EXCHANGE, left)
    done = []
    for where in ("device", "host"):
        for api in ("communicator", "torch"):
            ctx = tg.reference() if where == "host" else contextlib.nullcontext()
            with ctx:
                make = (lambda v: v.clone()) if where == "host" else tg.tensor
                x = make(data(torch.float32, RING_EXCHANGE, rank))
                y = make(torch.zeros(RING_EXCHANGE))
                if api == "communicator":
                    works = [comm.isend(x, right), comm.irecv(y, left)]
                else:
                    works = [dist.isend(x, right), dist.irecv(y, left)]
                for w in works:
                    w.wait()
                got = y.clone() if where == "host" else tg.host(y)
            assert torch.equal(got, want), f"{where} {api}: wrong data"
            done.append(f"{where} {api}")
    # host tensors queued on the lane behind a device op (their isend and irecv issued there)
    tg.delay(0.2)
    w0 = comm.all_reduce(tg.tensor(torch.ones(1000)), async_op=True)
    x, y = _as_host(data(torch.float32, RING_EXCHANGE, rank)), _as_host(torch.zeros(RING_EXCHANGE))
    works = [comm.isend(x, right), comm.irecv(y, left)]
    for w in works:
        w.wait()
    w0.wait()
    assert torch.equal(y, want), "host behind a device op: wrong data"
    done.append("host behind a device op")
    tg.check()
    return done


def case_issue37_coalesced_mixed_dtypes():
    """Defect 2: coalesced calls with several dtypes on the device, async and behind an earlier
    async op: all_reduce of non-contiguous tensors (copied back out of scratch) and
    reduce_scatter_tensor (copied out of the packed result), through torch's coalescing manager
    (one ``*_coalesced`` call, one oxcomm op per dtype). Every output must hold its own dtype's
    result once the Work is waited on, not what the later dtypes' ops had not copied back yet."""
    import torch.distributed as dist

    dist = _init()
    tg = target()
    rank, n = dist.get_rank(), dist.get_world_size()
    dtypes = (torch.float32, torch.int64, torch.bfloat16)
    total = lambda dtype, k, salt=0: sum(data(dtype, k, r, salt) for r in range(n))  # noqa: E731
    with tg.on(tg.stream()):
        first = tg.tensor(data(torch.float32, BIG, rank))
        w0 = dist.all_reduce(first, async_op=True)
        xs = [tg.tensor(data(dt, 64, rank, salt=k)).view(8, 8).t() for k, dt in enumerate(dtypes)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for x in xs:
                dist.all_reduce(x)
        outs = [tg.tensor(torch.zeros(12, dtype=dt)) for dt in dtypes]
        ins = [tg.tensor(data(dt, 12 * n, rank, salt=k)) for k, dt in enumerate(dtypes)]
        with dist._coalescing_manager(async_ops=True) as cm2:
            for o, i in zip(outs, ins):
                dist.reduce_scatter_tensor(o, i)
        cm.wait()
        cm2.wait()
        w0.wait()
        got_ar = [tg.host(x.contiguous()) for x in xs]
        got_rs = [tg.host(o) for o in outs]
    for k, dt in enumerate(dtypes):
        want = total(dt, 64, k).view(8, 8).t().contiguous()
        assert torch.equal(got_ar[k], want), f"all_reduce coalesced {dt}: {got_ar[k].flatten()[:6]} != {want.flatten()[:6]}"
        want = total(dt, 12 * n, k)[12 * rank : 12 * rank + 12]
        assert torch.equal(got_rs[k], want), f"reduce_scatter coalesced {dt}: {got_rs[k][:6]} != {want[:6]}"
    tg.check()
    return [str(dt) for dt in dtypes]


def case_issue37_blocking_all_reduce_behind_a_queued_device_op():
    """Defect 3: an async all_reduce of a device tensor through the Communicator, then a
    blocking dist.all_reduce of a host tensor of the same size. On rank 1 the device op stays
    queued on the communicator's lane (its input is written after a long kernel); on rank 0 it
    has started. The blocking call must queue behind it on rank 1, not overtake it (ranks would
    pair the two ops crosswise: swapped sums)."""
    import oxcomm.torch

    dist = _init()
    comm = oxcomm.torch.communicator()
    tg = target()
    rank, n = comm.rank, comm.size
    count = 4096
    x = tg.tensor(data(torch.float32, count, rank))
    h = _as_host(data(torch.float32, count, rank, salt=1) * 10)
    dist.all_reduce(_as_host(torch.zeros(1)))  # (the fast path takes a tensor class and dtype seen before)
    if rank == 0:
        tg.synchronize()  # the device op can start at once ...
    else:
        tg.delay(1.0)  # ... here it waits for its input for a second
    w = comm.all_reduce(x, async_op=True)
    if rank == 0:
        time.sleep(0.3)  # its host collective has started by now
    dist.all_reduce(h)
    w.wait()
    got = tg.host(x)
    assert torch.equal(got, sum(data(torch.float32, count, r) for r in range(n))), "the device op's sum is wrong"
    assert torch.equal(h.cpu(), sum(data(torch.float32, count, r, salt=1) * 10 for r in range(n))), "the host op's sum"
    tg.check()
    return "ok"


def case_issue37_threads_make_no_context_elsewhere():
    """Defect 4: async device ops completed every way (wait, a future and its then-callback, a
    point-to-point op waited on from the future's thread) leave no CUDA context on another device
    than the rank's, and a then-callback runs with the rank's device current, off the default
    stream. (On the fake device the rank's device is fake:1; on a one-GPU machine this checks
    only the callback's stream.)"""
    import oxcomm.torch

    dist = _init()
    comm = oxcomm.torch.communicator()
    tg = target()
    rank, n = comm.rank, comm.size
    seen = []
    with tg.on(tg.stream()):
        x = tg.tensor(data(torch.float32, 1000, rank))
        fut = dist.all_reduce(x, async_op=True).get_future()
        fut.then(lambda f: seen.append(tg.callback_context())).wait()
        y = tg.tensor(torch.zeros(1000))
        works = [comm.isend(x, (rank + 1) % n), comm.irecv(y, (rank - 1) % n)]
        for w in works:
            w.get_future().result(timeout=60)
        comm.all_reduce(y, async_op=True).synchronize()
        tg.synchronize()
    assert seen and all(ok for ok, _ in seen), seen
    tg.check()
    return [why for _, why in seen]


# ------------------------------------------------------------------------------- in pytest


@pytest.mark.worlds(2, 3)
def test_torch_ops_on_the_device_match_the_host(world, seed):
    res = run(world, "test_cuda_ops:case_torch_ops", seed, timeout=400)
    assert all(r == res[0] for r in res) and len(res[0]) > 100, res[0][:5]


@pytest.mark.worlds(2, 3)
def test_communicator_ops_on_the_device_match_the_host(world, seed):
    res = run(world, "test_cuda_ops:case_communicator_ops", seed, timeout=400)
    assert all(r == res[0] for r in res) and len(res[0]) > 150, res[0][:5]


@pytest.mark.parametrize("spec", ["oxcomm", "cpu:gloo,cuda:oxcomm"] if on_cuda() else ["oxcomm"])
def test_ddp_with_comm_hooks_on_the_device_matches_gloo(spec, seed):
    # (a mixed spec routes the fake device's tensors, CPU ones, to gloo: CUDA only)
    res = run(2, "test_cuda_ops:case_ddp", seed, timeout=300, env={"OXCOMM_TEST_SPEC": spec})
    if "unsupported" in res[0]:
        pytest.skip(f"torch {res[0]['unsupported']} cannot host a Python backend beside gloo's")
    assert all(d < 1e-5 for d in res[0].values()), res


def test_issue37_isend_before_irecv_above_the_ring(seed):
    res = run(2, "test_cuda_ops:case_issue37_isend_before_irecv_above_the_ring", seed, timeout=150,
              env={"OXCOMM_CUDA_TIMEOUT": "60"})
    assert res[0] == ["device communicator", "device torch", "host communicator", "host torch", "host behind a device op"], res


@pytest.mark.worlds(2, 3)
def test_issue37_coalesced_mixed_dtypes(world, seed):
    res = run(world, "test_cuda_ops:case_issue37_coalesced_mixed_dtypes", seed, timeout=150)
    assert len(res[0]) == 3


def test_issue37_blocking_all_reduce_behind_a_queued_device_op(seed):
    res = run(2, "test_cuda_ops:case_issue37_blocking_all_reduce_behind_a_queued_device_op", seed, timeout=120)
    assert res == ["ok", "ok"]


def test_issue37_threads_make_no_context_elsewhere(seed):
    res = run(2, "test_cuda_ops:case_issue37_threads_make_no_context_elsewhere", seed, timeout=120)
    assert all(r for r in res), res
