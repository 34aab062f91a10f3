"""The native Communicator from Python: every op on numpy arrays and torch CPU tensors of every
dtype, world sizes 1–4, empty and odd lengths, compared exactly with the same op run on gloo in
the same job (and with the closed-form answer); bad input; a mismatch, a killed rank and an
interrupted wait. Ranks are processes spawned by ``_torch_ranks.run`` (a parent-owned
TCPStore on port 0, a deadline, children killed on failure); each joins with
``oxcomm.Communicator.from_store``."""

import os

import pytest

import _torch_ranks

# dtype name -> (numpy dtype or None, torch dtype name)
DTYPES = {
    "f32": ("float32", "float32"),
    "f64": ("float64", "float64"),
    "f16": ("float16", "float16"),
    "bf16": (None, "bfloat16"),
    "i8": ("int8", "int8"),
    "u8": ("uint8", "uint8"),
    "i32": ("int32", "int32"),
    "i64": ("int64", "int64"),
}


def _join(timeout=60.0, gloo=False):
    """This rank's Communicator on the job's store; with ``gloo``, the default torch process
    group is also initialised on gloo (another prefix of the same store) for reference runs."""
    from datetime import timedelta

    import torch.distributed as dist

    import oxcomm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=60)
    )
    if gloo:
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo-reference", store), rank=rank, world_size=world)
    prefix = dist.PrefixStore(os.environ.get("OXCOMM_TEST_PREFIX", "native"), store)
    return oxcomm.Communicator.from_store(prefix, rank, world, timeout=timeout)


class _Gloo:
    """The same ops on gloo (torch tensors of the label's dtype), results as float lists."""

    def __init__(self, torch_dtype):
        import torch

        self.dt = getattr(torch, torch_dtype)

    def t(self, values):
        import torch

        return torch.tensor(values, dtype=torch.float64).to(self.dt)

    @staticmethod
    def out(t):
        import torch

        return t.to(torch.float64).tolist()

    def all_reduce(self, values, op):
        import torch.distributed as dist

        t = self.t(values)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return self.out(t)

    def reduce(self, values, dst):
        import torch.distributed as dist

        t = self.t(values)
        dist.reduce(t, dst=dst)
        return self.out(t)

    def broadcast(self, values, src):
        import torch.distributed as dist

        t = self.t(values)
        dist.broadcast(t, src=src)
        return self.out(t)

    def all_gather(self, values, n):
        import torch.distributed as dist

        parts = [self.t([0] * len(values)) for _ in range(n)]
        dist.all_gather(parts, self.t(values))
        return [v for p in parts for v in self.out(p)]

    def reduce_scatter(self, values, n):
        import torch.distributed as dist

        k = len(values) // n
        out = self.t([0] * k)
        dist.reduce_scatter(out, [self.t(values[i * k : (i + 1) * k]) for i in range(n)])
        return self.out(out)

    def all_to_all_v(self, values, send_counts, recv_counts):
        import torch.distributed as dist

        out = self.t([0] * sum(recv_counts))
        dist.all_to_all_single(out, self.t(values), list(recv_counts), list(send_counts))
        return self.out(out)

    def gather(self, values, n, dst):
        import torch.distributed as dist

        parts = [self.t([0] * len(values)) for _ in range(n)] if dist.get_rank() == dst else None
        dist.gather(self.t(values), parts, dst=dst)
        return [v for p in parts for v in self.out(p)] if parts is not None else None

    def scatter(self, values, n, length, src):
        import torch.distributed as dist

        out = self.t([0] * length)
        parts = [self.t(values[i * length : (i + 1) * length]) for i in range(n)] if values is not None else None
        dist.scatter(out, parts, src=src)
        return self.out(out)

    def ring(self, values):
        """Each rank sends ``values`` to the next rank; what arrives from the previous one."""
        import torch.distributed as dist

        r, n = dist.get_rank(), dist.get_world_size()
        got = self.t([0] * len(values))
        for w in (dist.isend(self.t(values), (r + 1) % n), dist.irecv(got, (r - 1) % n)):
            w.wait()
        return self.out(got)


def _makers():
    import numpy as np
    import torch

    out = []
    for name, (np_dt, t_dt) in DTYPES.items():
        if np_dt is not None:
            out.append(
                (f"numpy-{name}", lambda v, dt=np_dt: np.asarray(v).astype(dt), lambda x: np.asarray(x).tolist(), t_dt)
            )
        out.append(
            (
                f"torch-{name}",
                lambda v, dt=t_dt: torch.tensor(v, dtype=getattr(torch, dt)),
                lambda x: x.to(torch.float64).tolist(),
                t_dt,
            )
        )
    return out


def case_every_op():
    """Every op, every dtype, lengths 0, 1 and 5, small integers (exact in every dtype and any
    summation order): each result equals gloo's for the same op and inputs, and the closed form."""
    import oxcomm

    c = _join(gloo=True)
    r, n = c.rank, c.size
    checked = 0
    for label, make, back, t_dt in _makers():
        gloo = _Gloo(t_dt)
        for length in (0, 1, 5):
            base = [(i % 3) + 1 for i in range(length)]
            mine = [v + r for v in base]

            def same(what, got, want_gloo, want_formula):
                assert got == want_gloo, (label, length, what, "oxcomm", got, "gloo", want_gloo)
                assert got == want_formula, (label, length, what, "oxcomm", got, "closed form", want_formula)

            def want(f):
                return [float(f(i)) for i in range(length)]

            total = want(lambda i: n * base[i] + n * (n - 1) // 2)
            for op, name, f in (
                (oxcomm.ReduceOp.SUM, "SUM", None),
                (oxcomm.ReduceOp.MAX, "MAX", lambda i: base[i] + n - 1),
                (oxcomm.ReduceOp.MIN, "MIN", lambda i: base[i]),
            ):
                x = make(mine)
                c.all_reduce(x, op)
                same(f"all_reduce {name}", back(x), gloo.all_reduce(mine, name), total if f is None else want(f))
            if label.split("-")[1] in ("i8", "u8", "i32", "i64"):
                bits = [1 << r for _ in range(length)]
                x = make(bits)
                c.all_reduce(x, oxcomm.ReduceOp.BOR)
                same("all_reduce BOR", back(x), gloo.all_reduce(bits, "BOR"), [float((1 << n) - 1)] * length)
            out = make([0] * length)
            c.all_reduce_into(make(mine), out, oxcomm.ReduceOp.MAX)
            same("all_reduce_into MAX", back(out), gloo.all_reduce(mine, "MAX"), want(lambda i: base[i] + n - 1))
            x = make(mine)
            c.reduce(x, n - 1, oxcomm.ReduceOp.SUM)
            if r == n - 1:
                same("reduce", back(x), gloo.reduce(mine, n - 1), total)
            else:  # a non-root's buffer: oxcomm leaves it as it was (gloo may use it as scratch)
                gloo.reduce(mine, n - 1)
                assert back(x) == [float(v) for v in mine], (label, "reduce non-root")
            x = make(mine)
            c.broadcast(x, 0)
            same("broadcast", back(x), gloo.broadcast(mine, 0), [float(v) for v in base])
            g = make([0] * (length * n))
            c.all_gather(make(mine), g)
            gathered = [float(base[i] + k) for k in range(n) for i in range(length)]
            same("all_gather", back(g), gloo.all_gather(mine, n), gathered)
            rs_vals = [base[i % max(length, 1)] + r for i in range(length * n)] if length else []
            rs_out = make([0] * length)
            c.reduce_scatter(make(rs_vals), rs_out, oxcomm.ReduceOp.SUM)
            same(
                "reduce_scatter",
                back(rs_out),
                gloo.reduce_scatter(rs_vals, n),
                [float(n * base[(r * length + i) % length] + n * (n - 1) // 2) for i in range(length)],
            )
            a2a_vals = [10 * r + k for k in range(n) for _ in range(length)]
            recv = make([0] * (length * n))
            c.all_to_all(make(a2a_vals), recv)
            same(
                "all_to_all",
                back(recv),
                gloo.all_to_all_v(a2a_vals, [length] * n, [length] * n),
                [float(10 * k + r) for k in range(n) for _ in range(length)],
            )
            counts_out = [k + 1 for k in range(n)]  # rank r sends k+1 elements to rank k
            send_vals = [r for k in range(n) for _ in range(k + 1)]
            recv = make([0] * ((r + 1) * n))
            c.all_to_all_v(make(send_vals), counts_out, recv, [r + 1] * n)
            same(
                "all_to_all_v",
                back(recv),
                gloo.all_to_all_v(send_vals, counts_out, [r + 1] * n),
                [float(k) for k in range(n) for _ in range(r + 1)],
            )
            gout = make([0] * (length * n)) if r == 0 else None
            c.gather(make(mine), gout, 0)
            want_gather = gloo.gather(mine, n, 0)
            if r == 0:
                same("gather", back(gout), want_gather, gathered)
            scatter_vals = [k for k in range(n) for _ in range(length)] if r == 0 else None
            sout = make([0] * length)
            c.scatter(make(scatter_vals) if r == 0 else None, sout, 0)
            same("scatter", back(sout), gloo.scatter(scatter_vals, n, length, 0), [float(r)] * length)
            bufs = [make(mine), make(mine[:1])]
            c.all_reduce_coalesced(bufs, oxcomm.ReduceOp.SUM)
            same("all_reduce_coalesced[0]", back(bufs[0]), gloo.all_reduce(mine, "SUM"), total)
            same("all_reduce_coalesced[1]", back(bufs[1]), gloo.all_reduce(mine[:1], "SUM"), total[:1])
            x = make(mine)
            w = c.all_reduce(x, async_op=True)
            w.wait()
            assert w.is_completed()
            same("async all_reduce", back(x), gloo.all_reduce(mine, "SUM"), total)
            x = make(mine)
            w = c.broadcast(x, n - 1, async_op=True)
            w.get_future().result(timeout=30)
            same("async broadcast", back(x), gloo.broadcast(mine, n - 1), [float(v + n - 1) for v in base])
            if n > 1:
                peer = (r + 1) % n
                src = (r - 1) % n
                got = make([0] * length)
                works = [c.isend(make(mine), peer, tag=3), c.irecv(got, src, tag=3)]
                for w in works:
                    w.wait()
                same("isend/irecv", back(got), gloo.ring(mine), [float(v + src) for v in base])
                if r == 0:
                    c.send(make(mine), 1)
                elif r == 1:
                    got = make([0] * length)
                    c.recv(got, 0)
                    assert back(got) == [float(v) for v in base], (label, "send/recv")
            checked += 1
    c.barrier()
    c.barrier(async_op=True).wait()
    c.monitored_barrier(30)
    assert c.all_gather_object({"rank": r}) == [{"rank": k} for k in range(n)]
    assert c.broadcast_object(("hello", r) if r == 0 else None, 0) == ("hello", 0)
    evens = c.new_group(list(range(0, n, 2)))
    assert (evens is None) == (r % 2 == 1)
    half = c.split(r % 2, key=-r)
    members = [k for k in range(n) if k % 2 == r % 2]
    assert half.size == len(members) and half.rank == sorted(members, reverse=True).index(r)
    mine_only = c.group([r])
    import numpy as np

    x = np.ones(3, dtype=np.float32)
    mine_only.all_reduce(x)
    assert x.tolist() == [1.0] * 3
    return {"checked": checked, "transport": c.transport}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_every_dtype(world):
    res = _torch_ranks.run(world, "test_native:case_every_op", timeout=240)
    assert all(r["checked"] == 3 * (2 * len(DTYPES) - 1) for r in res), res


def case_in_place_forms():
    """The in-place forms and ``reduce_into`` (numpy and torch): explicit, and picked by the
    out-of-place calls when the buffers are laid out as MPI_IN_PLACE's (a view of the rank's
    block, or the same buffer); results in closed form, inputs that are only read unchanged."""
    import numpy as np
    import torch

    import oxcomm

    c = _join()
    r, n = c.rank, c.size
    m = 3
    for lib in ("numpy", "torch"):

        def arr(values, lib=lib):
            return np.array(values, dtype=np.float32) if lib == "numpy" else torch.tensor(values, dtype=torch.float32)

        def vals(x):
            return [float(v) for v in x.tolist()]

        gathered = [float(10 * k + j) for k in range(n) for j in range(m)]
        mine = [float(10 * r + j) for j in range(m)]
        # all_gather: explicit, and with the input a view of this rank's block of the output.
        buf = arr([-1.0] * (n * m))
        buf[r * m : (r + 1) * m] = arr(mine)
        c.all_gather_in_place(buf)
        assert vals(buf) == gathered, (lib, "all_gather_in_place", vals(buf))
        buf = arr([-1.0] * (n * m))
        buf[r * m : (r + 1) * m] = arr(mine)
        c.all_gather(buf[r * m : (r + 1) * m], buf)
        assert vals(buf) == gathered, (lib, "all_gather of a view", vals(buf))
        # reduce_scatter in place: this rank's block holds its block of the sum.
        buf = arr([float(k + r) for k in range(n * m)])
        c.reduce_scatter_in_place(buf)
        want = [float(n * (r * m + j) + n * (n - 1) // 2) for j in range(m)]
        assert vals(buf[r * m : (r + 1) * m]) == want, (lib, "reduce_scatter_in_place", vals(buf))
        # all_to_all: explicit, and with send and recv the same buffer.
        a2a = [float(100 * r + 10 * k + j) for k in range(n) for j in range(m)]
        want = [float(100 * k + 10 * r + j) for k in range(n) for j in range(m)]
        buf = arr(a2a)
        c.all_to_all_in_place(buf)
        assert vals(buf) == want, (lib, "all_to_all_in_place", vals(buf))
        buf = arr(a2a)
        c.all_to_all(buf, buf)
        assert vals(buf) == want, (lib, "all_to_all(buf, buf)", vals(buf))
        for root in range(n):
            # gather: the root's input a view of its block of the output, or explicit.
            if r == root:
                out = arr([-1.0] * (n * m))
                out[r * m : (r + 1) * m] = arr(mine)
                c.gather(out[r * m : (r + 1) * m], out, root)
                assert vals(out) == gathered, (lib, "gather of a view", root, vals(out))
                out = arr([-1.0] * (n * m))
                out[r * m : (r + 1) * m] = arr(mine)
                c.gather_in_place(out, root)
                assert vals(out) == gathered, (lib, "gather_in_place", root, vals(out))
            else:
                x = arr(mine)
                c.gather(x, None, root)
                c.gather_in_place(x, root)
                assert vals(x) == mine, (lib, "gather non-root input changed", vals(x))
            # scatter: the root's output a view of its block of the input, or explicit.
            if r == root:
                src = arr(gathered)
                c.scatter(src, src[r * m : (r + 1) * m], root)
                assert vals(src) == gathered, (lib, "scatter of a view", root, vals(src))
                c.scatter_in_place(src, root)
                assert vals(src) == gathered, (lib, "scatter_in_place root", root, vals(src))
            else:
                for in_place in (False, True):
                    out = arr([-1.0] * m)
                    if in_place:
                        c.scatter_in_place(out, root)
                    else:
                        c.scatter(None, out, root)
                    assert vals(out) == mine, (lib, "scatter", in_place, root, vals(out))
            # reduce_into: the root's output gets the sum; every input is left as it was.
            x = arr(mine)
            out = arr([-1.0] * m) if r == root else None
            c.reduce_into(x, out, root, oxcomm.ReduceOp.SUM)
            assert vals(x) == mine, (lib, "reduce_into input changed", vals(x))
            if r == root:
                want = [float(10 * n * (n - 1) // 2 + n * j) for j in range(m)]
                assert vals(out) == want, (lib, "reduce_into", root, vals(out))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_in_place_forms_and_reduce_into(world):
    assert _torch_ranks.run(world, "test_native:case_in_place_forms", timeout=120) == [True] * world


def case_compressed():
    import numpy as np
    import torch

    import oxcomm

    c = _join()
    n = c.size
    # One sign and one magnitude per rank: the signs and scales lose nothing, so the 1-bit
    # all-reduce gives the exact mean and leaves zero error (padding zeros would shrink the scale).
    x = np.full(1024, c.rank + 1.0, dtype=np.float32)  # a multiple of 8 × size: no padding
    state = oxcomm.onebit.State(x.size, c)
    oxcomm.onebit.all_reduce(c, x, state)
    assert np.allclose(x, (n + 1) / 2, rtol=1e-6), x[:4]
    assert np.abs(state.worker_error()).max() < 1e-5 and np.abs(state.server_error()).max() < 1e-5
    parts = oxcomm.coalesced.reduce_scatter_coalesced(c, [torch.full((10,), float(c.rank)), torch.ones(3)])
    assert torch.allclose(parts[0], torch.full_like(parts[0], (n - 1) / 2))
    q = oxcomm.coalesced.all_to_all_quant_reduce(c, [torch.full((4, 8 * n), 1.0 + c.rank)])
    # int4 codes: within the documented bound (2/W) · Σ_ranks amax_r / 8 of the mean.
    bound = 2 / n * sum((1.0 + k) / 8 for k in range(n))
    assert q[0].numel() > 0 and (q[0] - (1 + (n - 1) / 2)).abs().max() <= bound, q[0]
    # oxcomm.onebit.Adam: while warming up, DeepSpeed's update with the averaged gradient (no
    # bias correction; a float64 reference here); frozen after call `freeze_step`, then the
    # momentum is compressed and every rank still holds the same parameters.
    params = np.linspace(-1, 1, 64).astype(np.float32)
    ref, m, v = params.astype(np.float64), np.zeros(64), np.zeros(64)
    opt = oxcomm.onebit.Adam(lr=1e-2, freeze_step=4)
    for k in range(1, 7):
        grads = (np.arange(64) % 5 + c.rank + k).astype(np.float32)
        mean = np.arange(64) % 5 + (n - 1) / 2 + k
        opt.step(c, params, grads)
        assert opt.steps == k and opt.frozen == (k >= 4), (k, opt.steps, opt.frozen)
        if k <= 4:
            assert np.allclose(grads, mean, rtol=1e-6), (k, grads[:4], mean[:4])
        if 2 <= k <= 4:
            m = 0.9 * m + 0.1 * mean
            v = 0.999 * v + 0.001 * mean * mean
            ref = ref - 1e-2 * m / (np.sqrt(v) + 1e-8)
            assert np.allclose(params, ref, rtol=1e-5, atol=1e-6), (k, params[:4], ref[:4])
    every = np.zeros(64 * n, dtype=np.float32)
    c.all_gather(params, every)
    assert all((every[r * 64 : (r + 1) * 64] == params).all() for r in range(n)), "ranks' parameters differ"
    assert np.isfinite(params).all() and not np.allclose(params, ref), "the compressed calls changed nothing"
    return True


def test_compressed_collectives():
    assert _torch_ranks.run(2, "test_native:case_compressed", timeout=120) == [True, True]


def case_bad_input():
    import numpy as np
    import torch

    import oxcomm

    c = _join()
    errors = []
    for bad, kind in (
        (np.zeros(3, dtype=np.longdouble), TypeError),
        (torch.zeros(3, dtype=torch.complex32), TypeError),
        (torch.zeros(3, device="meta"), ValueError),
        (np.zeros((4, 4), dtype=np.float32)[:, 1], ValueError),
        ("not a buffer", TypeError),
    ):
        with pytest.raises(kind) as e:
            c.all_reduce(bad)
        assert "buf" in str(e.value), e.value
        errors.append(type(e.value).__name__)
    ro = np.zeros(3, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        c.broadcast(ro, 0)
    with pytest.raises(TypeError, match="output"):
        c.all_gather(np.zeros(1, np.float32), np.zeros(c.size, np.float64))
    shared = np.zeros(8, dtype=np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        c.all_reduce_coalesced([shared[:5], np.ones(2, np.float32), shared[4:]])
    # nothing was sent: the next op works
    x = np.ones(2, dtype=np.float32)
    c.all_reduce(x)
    assert x.tolist() == [c.size] * 2
    # different sizes across ranks: every rank fails, naming the other
    with pytest.raises(oxcomm.MismatchError) as e:
        c.all_reduce(np.zeros(3 + c.rank, dtype=np.float32))
    assert e.value.rank == c.rank and e.value.peer == 1 - c.rank and "all_reduce" in e.value.op, e.value
    assert "f32 × 3" in str(e.value) and "f32 × 4" in str(e.value), e.value
    return errors


def test_bad_input_is_refused_before_anything_is_sent():
    res = _torch_ranks.run(2, "test_native:case_bad_input", timeout=120)
    assert res[0] == res[1]


def case_recv_from_any_source():
    """``recv``/``irecv`` with ``src=None``: rank 0 takes every other rank's messages as they
    come (each sender's in order), a message with another tag waits for its own receive, and
    the Work of an ``irecv`` names its sender; a same-tag message of another size is refused
    naming the sender."""
    import numpy as np

    import oxcomm

    c = _join(timeout=60)
    r, n = c.rank, c.size
    senders = []
    if r == 0:
        nxt = [0] * n
        for _ in range(3 * (n - 1)):
            buf = np.zeros(2, dtype=np.int64)
            src = c.recv(buf, None, tag=4)
            assert list(buf) == [src, nxt[src]], (buf, src, nxt)
            nxt[src] += 1
            senders.append(src)
        # rank 1 sent tag 9 first, then tag 8: the tag-8 receive from any source takes rank 2's
        # (rank 1's tag-8 message is behind its tag-9 one).
        got = np.zeros(3, dtype=np.float32)
        w = c.irecv(got, None, tag=8)
        assert w.wait(timeout=60)
        assert w.source_rank() == 2 and list(got) == [2.0] * 3, (w.source_rank(), got)
        late = np.zeros(3, dtype=np.float32)
        assert c.recv(late, 1, tag=9) == 1 and list(late) == [1.0] * 3
        assert c.recv(late, 1, tag=8) == 1
        with pytest.raises(oxcomm.OxcommError) as e:
            c.recv(np.zeros(5, dtype=np.float32), None, tag=6)
        assert e.value.peer == 1 and "any source" in str(e.value), e.value
    else:
        for i in range(3):
            c.send(np.array([r, i], dtype=np.int64), 0, tag=4)
        if r == 1:
            c.send(np.full(3, 1.0, dtype=np.float32), 0, tag=9)
            c.send(np.zeros(1, dtype=np.uint8), 2, tag=1)  # now rank 2 may send
            c.send(np.full(3, 1.0, dtype=np.float32), 0, tag=8)
            c.send(np.zeros(4, dtype=np.float32), 0, tag=6)
        elif r == 2:
            c.recv(np.zeros(1, dtype=np.uint8), 1, tag=1)
            c.send(np.full(3, 2.0, dtype=np.float32), 0, tag=8)
    return sorted(senders)


def test_recv_from_any_source():
    res = _torch_ranks.run(3, "test_native:case_recv_from_any_source", timeout=120)
    assert res[0] == [1, 1, 1, 2, 2, 2]


def case_premul_sum():
    """``all_reduce_premul_sum``: each rank's buffer times its own factor, summed; exact on
    float, integer and complex numpy arrays and torch tensors, sync and async; a fractional
    factor on integers is refused before anything is sent."""
    import numpy as np
    import torch

    c = _join(timeout=60)
    r, n = c.rank, c.size
    base = np.arange(100)
    out = {}
    for dt in ("float32", "int64", "complex64"):
        x = (base + r).astype(dt)
        factor = complex(1, r) if dt == "complex64" else r + 2
        want = sum((base + k).astype(dt) * (complex(1, k) if dt == "complex64" else k + 2) for k in range(n))
        c.all_reduce_premul_sum(x, factor)
        assert np.array_equal(x, want), (dt, x[:4], want[:4])
        out[dt] = True
    t = torch.arange(10, dtype=torch.float64) * (r + 1)
    w = c.all_reduce_premul_sum(t, 0.5, async_op=True)
    w.wait()
    assert torch.equal(t, torch.arange(10, dtype=torch.float64) * 0.5 * sum(k + 1 for k in range(n)))
    with pytest.raises(ValueError, match="exactly"):
        c.all_reduce_premul_sum(np.zeros(3, dtype=np.int32), 0.5)
    c.barrier()
    return sorted(out)


def test_premul_sum():
    res = _torch_ranks.run(3, "test_native:case_premul_sum", timeout=120)
    assert res[0] == ["complex64", "float32", "int64"]


def case_killed_rank():
    import signal
    import time

    import numpy as np

    import oxcomm

    c = _join(timeout=60)
    c.barrier()
    if c.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    t = time.monotonic()
    with pytest.raises(oxcomm.OxcommError) as e:
        c.all_reduce(np.ones(1 << 16, dtype=np.float32))
    took = time.monotonic() - t
    assert e.value.peer == 1, e.value
    assert took < 2.0, took
    return round(took, 3)


def test_a_killed_rank_is_named_within_2_s():
    res = _torch_ranks.run(2, "test_native:case_killed_rank", timeout=120, may_die=(1,))
    assert res[1] is None and res[0] < 2.0


def case_interrupt():
    import signal
    import threading
    import time

    import numpy as np

    import oxcomm

    c = _join(timeout=60)
    if c.rank == 1:
        time.sleep(6)
        return "slept"
    out = {}
    # A thread keeps running while the main thread waits (the GIL is released).
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.01)

    threading.Thread(target=ticker, daemon=True).start()
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    try:
        c.all_reduce(np.ones(4, dtype=np.float32))
        raise AssertionError("the op returned")
    except KeyboardInterrupt:
        out["sync"] = time.monotonic() - t - 1.0
    stop.set()
    out["ticks"] = len(ticks)
    with pytest.raises(oxcomm.AbortedError):
        c.barrier()
    # Work.wait on a second communicator
    return out


def test_ctrl_c_during_a_sync_op_raises_keyboard_interrupt_and_aborts():
    res = _torch_ranks.run(2, "test_native:case_interrupt", timeout=120)
    assert res[1] == "slept"
    assert res[0]["sync"] < 1.0, res
    assert res[0]["ticks"] > 20, res


def case_interrupt_async():
    import signal
    import threading
    import time

    import numpy as np

    import oxcomm

    c = _join(timeout=60)
    if c.rank == 1:
        time.sleep(6)
        return "slept"
    w = c.all_reduce(np.ones(4, dtype=np.float32), async_op=True)
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t = time.monotonic()
    try:
        w.wait()
        raise AssertionError("the wait returned")
    except KeyboardInterrupt:
        took = time.monotonic() - t - 1.0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            c.barrier()
        except oxcomm.AbortedError:
            return took
        time.sleep(0.05)
    raise AssertionError("the communicator was not aborted")


def test_ctrl_c_during_work_wait():
    res = _torch_ranks.run(2, "test_native:case_interrupt_async", timeout=120)
    assert res[1] == "slept" and res[0] < 1.0, res
