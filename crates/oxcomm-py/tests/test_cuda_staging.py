"""The CUDA staging path's parts that need no device, the fake device the CUDA tests run on in
CI, and the routing of a mixed backend spec.

The ops on device tensors themselves are tested by ``tests_cuda/`` (CI runs that folder on the
fake device of ``_fake_device.py``; a GPU machine on CUDA). Here: the pinned pool, the layout of
parts, the plan of chunks (pure functions); the fake device's own promises (a test that relies
on a fake that does not run late would prove nothing); and a ``"device:backend"`` spec that mixes
oxcomm with gloo.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import _torch_ranks

torch = pytest.importorskip("torch")

from oxcomm._cuda import device as _device  # noqa: E402
from oxcomm._cuda import pool as _pool  # noqa: E402
from oxcomm._cuda import staging as _staging  # noqa: E402

from _fake_device import MARKER, FakeDevice  # noqa: E402

# ------------------------------------------------------------------------------- pure parts


def test_pool_reuses_buffers_and_grows_to_the_largest():
    pool = _pool.PinnedPool(_HostOnly())
    a = pool.take(1000)
    pool.give([a], None)
    assert pool.take(500) is a  # reused
    pool.give([a], None)
    b = pool.take(10 * _pool.GRAIN)  # larger: replaces a
    assert b is not a and b.capacity >= 10 * _pool.GRAIN and pool.allocated == 2
    pool.give([b], "ev")
    assert pool.take(700) is b and b.released == "ev"


def test_pool_keeps_at_most_its_cap(monkeypatch):
    monkeypatch.setattr(_pool, "KEEP_BYTES", 4 * _pool.GRAIN)
    pool = _pool.PinnedPool(_HostOnly())
    small, big = pool.take(_pool.GRAIN), pool.take(10 * _pool.GRAIN)
    pool.give([small, big], None)
    assert pool._free == [small]  # the big one dropped: over the cap
    assert pool.take(100) is small


def test_layout_aligns_every_part():
    offsets, total = _pool.layout([10, 0, 300, 4])
    assert offsets == [0, 256, 256, 768] and total == 1024
    assert all(o % _pool.ALIGN == 0 for o in offsets)


def test_plan_cuts_equal_elementwise_tensors_into_chunks(monkeypatch):
    monkeypatch.setattr(_staging, "CHUNK_BYTES", 64)
    x = torch.arange(100, dtype=torch.float32)
    y = torch.zeros(100, dtype=torch.float32)
    parts = _staging.plan([_staging.R(x), _staging.W(y)], chunked=True)
    assert len(parts) == 7  # 16 floats a part
    assert [p[0][0].numel() for p in parts] == [16] * 6 + [4]
    assert torch.equal(torch.cat([p[0][0] for p in parts]), x)
    # overlapping input and output, unequal lengths, or not elementwise: one part
    assert len(_staging.plan([_staging.R(x[:50]), _staging.W(x[10:60])], chunked=True)) == 1
    assert len(_staging.plan([_staging.R(x), _staging.W(y[:50])], chunked=True)) == 1
    assert len(_staging.plan([_staging.R(x), _staging.W(y)], chunked=False)) == 1
    assert len(_staging.plan([_staging.RW(torch.zeros(0))], chunked=True)) == 1


class _HostOnly:
    """The one thing the pool asks of a device."""

    @staticmethod
    def pinned(nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)


# ------------------------------------------------------------------------------- the fake device


def _fake(seed=0, **kw):
    return FakeDevice(seed, **kw)


def _in_thread(fn):
    """Run ``fn`` on a fresh thread (the fake's modes are per thread); its return value."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    assert out, "the thread did not finish"
    return out[0]


def test_fake_copies_run_late_and_show_the_marker_until_their_event():
    def body():
        fake = _fake(1, max_delay=0.05)
        fake.use(fake.key_)
        src = torch.arange(1000, dtype=torch.float32)
        dst = fake.pinned(4000).view(torch.float32)
        s = fake.new_stream(fake.key_)
        fake.sleep(s, 0.05)
        fake.copy(dst, src, s)
        ev = fake.record(s)
        early = dst.clone()  # a host read before the event: not the data
        assert not fake.query(ev)
        fake.host_wait(ev, time.monotonic() + 10, "test")
        return early, dst.clone(), src

    early, late, src = _in_thread(body)
    assert (early.view(torch.uint8) == MARKER).all()
    assert torch.equal(late, src)


def test_fake_streams_run_concurrently_and_only_events_order_them():
    def body():
        fake = _fake(2)
        fake.use(fake.key_)
        a, b = fake.new_stream(fake.key_), fake.new_stream(fake.key_)
        order = []
        fake.sleep(a, 0.2)
        fake.launch(a, lambda: order.append("a"))
        fake.launch(b, lambda: order.append("b"))  # b does not wait for a
        fake.host_wait(fake.record(a), time.monotonic() + 10, "a")
        before = list(order)
        c = fake.new_stream(fake.key_)
        fake.sleep(a, 0.1)
        fake.launch(a, lambda: order.append("a2"))
        fake.wait(c, fake.record(a))  # c waits for a
        fake.launch(c, lambda: order.append("c"))
        fake.host_wait(fake.record(c), time.monotonic() + 10, "c")
        return before, order

    before, order = _in_thread(body)
    assert before == ["b", "a"], before
    assert order[-2:] == ["a2", "c"], order


def test_fake_in_place_ops_are_kernels_of_the_current_stream():
    def body():
        fake = _fake(3)
        fake.use(fake.key_)
        x = torch.zeros(4)
        s = fake.new_stream(fake.key_)
        with fake.use_stream(s):
            fake.sleep(s, 0.1)
            x.add_(1)  # queued behind the sleep: returns at once
            t0 = time.monotonic()
            y = x * 2  # returns a new tensor: after the stream's work
            waited = time.monotonic() - t0
        return y, waited, fake.owns(x), fake.owns(fake.host(torch.ones(2))), fake.owns(fake.pinned(8))

    y, waited, dev_x, dev_host, dev_pinned = _in_thread(body)
    assert torch.equal(y, torch.full((4,), 2.0)) and waited >= 0.05, (y, waited)
    assert dev_x and not dev_host and not dev_pinned


def test_fake_names_a_context_made_on_another_device():
    def body():
        fake = _fake(4)
        s = fake.new_stream(fake.key_)
        with fake.on_stream(s):  # this thread never made fake:1 current: its device is 0
            pass
        return dict(fake.contexts)

    assert list(_in_thread(body)) == [0]


def test_fake_host_wait_has_a_deadline():
    import oxcomm

    def body():
        fake = _fake(5)
        s = fake.new_stream(fake.key_)
        fake.sleep(s, 2.0)
        try:
            fake.host_wait(fake.record(s), time.monotonic() + 0.1, "a stuck copy")
        except oxcomm.TimeoutError as e:
            return str(e)
        return None

    msg = _in_thread(body)
    assert msg and "a stuck copy" in msg and "timed out" in msg


# ------------------------------------------------------------------------------- mixed spec


def _torch_init(spec="oxcomm"):
    import torch.distributed as dist

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group(spec)
    return dist


def case_mixed_spec():
    """A "device:backend" spec that mixes oxcomm with gloo: CPU tensors go to the CPU backend
    named, the group lists both devices, and DDP on CPU trains as on plain gloo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oxcomm.torch.process_group import BackendOxcomm, python_backends_supported

    spec = os.environ["OXCOMM_TEST_SPEC"]
    if not python_backends_supported():
        # this torch cannot host a Python backend beside another: the spec is refused, clearly
        import pytest

        with pytest.raises(RuntimeError, match="cannot run a Python backend beside another one"):
            _torch_init(spec)
        return {"refused": spec}
    dist = _torch_init(spec)
    rank = dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    cpu = type(pg._get_backend(torch.device("cpu"))).__name__
    cuda = type(pg._get_backend(torch.device("cuda"))).__name__
    want_cpu = "BackendOxcomm" if spec.startswith("cpu:oxcomm") else "ProcessGroupGloo"
    assert cpu == want_cpu, (spec, cpu)
    assert sorted(d.type for d in pg._device_types) == ["cpu", "cuda"], pg._device_types
    if spec.startswith("cpu:oxcomm"):
        import oxcomm.torch

        assert isinstance(pg._get_backend(torch.device("cpu")), BackendOxcomm)
        assert oxcomm.torch.communicator() is not None
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    w = dist.all_reduce(torch.ones(3), async_op=True)
    w.wait()
    gl = dist.new_group(backend="gloo")
    torch.manual_seed(7)
    model = torch.nn.Linear(8, 2)
    a = DDP(torch.nn.Linear(8, 2))
    b = DDP(model, process_group=gl)
    b.module.load_state_dict(a.module.state_dict())
    for net in (a, b):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(5):
            opt.zero_grad()
            net(torch.randn(4, 8, generator=gen)).square().mean().backward()
            opt.step()
    pa = torch.cat([p.detach().flatten() for p in a.parameters()])
    pb = torch.cat([p.detach().flatten() for p in b.parameters()])
    assert torch.allclose(pa, pb, atol=1e-6), (pa - pb).abs().max()
    return {"cpu": cpu, "cuda": cuda, "sum": x.tolist()}


# ------------------------------------------------------------------------------- in pytest


@pytest.mark.parametrize(
    "spec,cpu,cuda",
    [
        ("cpu:oxcomm,cuda:gloo", "BackendOxcomm", "ProcessGroupGloo"),
        ("cpu:gloo,cuda:oxcomm", "ProcessGroupGloo", "BackendOxcomm"),
    ],
)
def test_mixed_spec_routes_each_device_to_its_backend(spec, cpu, cuda):
    res = _torch_ranks.run(2, "test_cuda_staging:case_mixed_spec", timeout=90, env={"OXCOMM_TEST_SPEC": spec})
    from oxcomm.torch.process_group import python_backends_supported

    if not python_backends_supported():  # an older torch: refused with a clear error (checked there)
        assert res == [{"refused": spec}] * 2, res
        return
    assert res[0]["cpu"] == cpu and res[0]["cuda"] == cuda, res[0]
    assert res[0]["sum"] == [3.0 * k for k in range(10)]
