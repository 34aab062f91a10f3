"""Device tensors through oxcomm's host collectives: copy out, run on the host, copy back.

This module owns the data path of an op on device tensors and its stream semantics. It does not
decide which tensors an op reads or writes (``ops.py`` does), when a queued op runs
(``work.py``), or how a device is driven (``device.py``).

Vocabulary. An op *stages* some device tensors, each *read* (copied to the host before the host
op), *written* (copied back after it) or both. A *part* is one run of the host op on pinned
host views of one piece of each staged tensor; a *slot* is the pinned buffer a part occupies.
Elementwise ops (all_reduce, reduce, broadcast and their out-of-place forms) are cut into parts
of ``OXCOMM_CUDA_CHUNK_BYTES`` (every rank cuts them alike, so part k of every rank meets part k
of the others); every other op is one part: the whole of each tensor goes out in one copy and
back in one copy.

Streams and events, per op (``d2h`` and ``h2d`` are the communicator's two copy streams on the
tensors' device; "ready" is recorded on the caller's current stream when the op is called):

    d2h waits ready; h2d waits ready                    (the op sees the caller's earlier work)
    part k:  d2h waits slot's release; D2H copies; filled[k] = record(d2h)
             host waits filled[k]; host op on the slot  (the host never reads a slot early)
             H2D copies on h2d; release[k] = record(h2d)  (part k + SLOTS reuses the slot after it)
    final = record(h2d) after the last part (and the caller's epilogue, see :func:`then`)
    the caller's current stream waits final             (later work sees the result)

With ``SLOTS`` = 3, the D2H of part k+1, the host op of part k and the H2D of part k-1 overlap.
The host blocks only on ``filled[k]`` (the copy its own next step reads); it never synchronizes
the device. Slots come from the communicator's :class:`~.pool.PinnedPool` and go back to it with
``final``, so the next op's first copy into a slot waits for this op's last one.

Cost per op of n bytes: n bytes D2H and n bytes H2D per staged tensor (only what is read or
written crosses PCIe), plus the host op; for a chunked op the copies hide behind the host op
except for the first part's D2H and the last part's H2D (2 · CHUNK_BYTES / PCIe bandwidth).
"""

from __future__ import annotations

import os
import threading
import time

from .._buffers import check_device
from . import device as _device
from .pool import PinnedPool, layout
from .work import DeviceJob, HostJob, Lane

#: Bytes per part of a chunked op: ``OXCOMM_CUDA_CHUNK_BYTES``, default 4 MiB. Every rank must
#: use the same value (the parts are separate host collectives). Smaller parts overlap more of
#: the copies with the host collective (the unhidden head and tail are one part each), larger
#: parts pay the per-op latency of the host collective (~10-30 µs) fewer times; at 4 MiB a part's
#: PCIe copy (~0.2 ms at 20 GB/s) is about 10× that latency, and three slots cost 12 MiB pinned.
CHUNK_BYTES = int(os.environ.get("OXCOMM_CUDA_CHUNK_BYTES", str(4 << 20)))
if CHUNK_BYTES <= 0:
    raise ValueError(f"OXCOMM_CUDA_CHUNK_BYTES={CHUNK_BYTES}: must be a positive number of bytes")

#: Pinned slots a chunked op cycles through: one being filled, one in the host op, one being
#: copied back.
SLOTS = 3

_local = threading.local()


class then:  # noqa: N801 - used as a context manager, like torch.cuda.stream
    """``with then(fn): <ops on device tensors, async>``: ``fn()`` runs on the device after the
    copies back of the block's ops, before their completion (its torch ops go to the copy
    stream). The torch backend uses it to copy out of scratch tensors after a call that is one
    oxcomm op per dtype. ``fn`` goes with the block's *last* device op: the ops of a block are
    one communicator's, on one device, so their copies back are queued in issue order on one
    copy stream and the last one's come after all the others'. A block without device ops (the
    call's tensors turned out to be host memory) runs ``fn`` at its end."""

    def __init__(self, fn):
        self.fn = fn
        self.jobs = []

    def __enter__(self):
        self._outer = getattr(_local, "block", None)
        _local.block = self
        return self

    def __exit__(self, kind, *exc):
        _local.block = self._outer
        if kind is not None or self.fn is None:
            return
        if self.jobs:
            self.jobs[-1].then(self.fn)
        else:
            self.fn()


class Staged:
    """One tensor of an op: ``t`` (device or host), and whether the op reads or writes it."""

    __slots__ = ("t", "read", "write")

    def __init__(self, t, read, write):
        self.t, self.read, self.write = t, read, write


def R(t):
    return Staged(t, True, False)


def W(t):
    return Staged(t, False, True)


def RW(t):
    return Staged(t, True, True)


def _flat(t):
    return t.view(-1) if t.dim() != 1 else t


def _overlap(a, b):
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def plan(staged, chunked):
    """The parts of an op: a list of parts, each a list (one entry per staged tensor, ``None``
    for an absent one) of ``(device view, read, write)``. Chunked ops whose staged tensors all
    have one length, and whose written tensors overlap no other staged tensor, are cut into
    parts of at most :data:`CHUNK_BYTES`; anything else is one part."""
    present = [s for s in staged if s is not None]
    views = [None if s is None else (_flat(s.t), s.read, s.write) for s in staged]
    if not chunked or not present:
        return [views]
    n = present[0].t.numel()
    size = present[0].t.element_size()
    if any(s.t.numel() != n or s.t.element_size() != size for s in present):
        return [views]
    written = [s.t for s in present if s.write]
    if any(w is not s.t and _overlap(w, s.t) for w in written for s in present):
        return [views]
    step = max(1, CHUNK_BYTES // size)
    if n <= step:
        return [views]
    return [
        [None if v is None else (v[0][lo : lo + step], v[1], v[2]) for v in views] for lo in range(0, n, step)
    ]


class Stager:
    """The staging state of one communicator: its host-only twin, pinned pool, copy streams per
    device and lane."""

    def __init__(self, host, name):
        #: The same communicator with staging off (its ops take host buffers only).
        self.host = host
        self.device = _device.device()
        self.pool = PinnedPool(self.device)
        self.lane = Lane(name)
        self._streams = {}
        self._lock = threading.Lock()

    def streams(self, key):
        with self._lock:
            s = self._streams.get(key)
            if s is None:
                s = self._streams[key] = (self.device.new_stream(key), self.device.new_stream(key))
            return s

    def drain(self, what):
        self.lane.drain(what)

    # ------------------------------------------------------------------ running an op

    def run(self, what, async_op, staged, start, *, chunked=False, p2p=False):
        """Run an op over ``staged`` (a list of :class:`Staged` or ``None``).

        ``start(bufs, async_op)`` issues the host op on ``bufs``, the staged tensors' host
        buffers in order (``None`` for an absent one). With no device tensor, ``bufs`` are the
        tensors themselves and the op runs as it would without staging, behind the lane's
        queue if there is one. ``p2p``: a point-to-point op; ``start`` is called with
        ``async_op=True`` and returns a native Work that the op's completion waits for.
        """
        key = self._device_of(what, staged)
        if key is None:
            bufs = [None if s is None else s.t for s in staged]
            if self.lane.idle():
                return start(bufs, async_op)
            job = HostJob(start, bufs, what, has_async=async_op or p2p, lane=self.lane if p2p else None)
            self.lane.submit(job)
            if async_op:
                return job
            job.wait()
            return None
        dev = self.device
        ready = dev.record(dev.current_stream(key))
        op = _Op(self, what, key, ready, plan(staged, chunked and not p2p), start, p2p)
        job = DeviceJob(dev, key, what, op, self.lane)
        block = getattr(_local, "block", None)
        if block is not None:
            block.jobs.append(job)
        if not async_op and self.lane.idle():
            job.run()
            job.wait()
            return None
        self.lane.submit(job)
        if async_op:
            return job
        job.wait()
        return None

    def _device_of(self, what, staged):
        """The device key of the op's device tensors; ``None`` if it has none. Raises
        ``ValueError`` naming the op for device and host tensors mixed, or two devices."""
        dev = self.device
        key = None
        host = None
        for s in staged:
            if s is None:
                continue
            if dev.owns(s.t):
                check_device(s.t, f"oxcomm: {what}")
                k = dev.key(s.t)
                if key is not None and k != key:
                    raise ValueError(f"oxcomm: {what}: tensors on {key} and on {k}; one op takes one device")
                key = k
            else:
                host = s.t
        if key is not None and host is not None:
            where = getattr(host, "device", type(host).__name__)
            raise ValueError(
                f"oxcomm: {what}: device tensors ({key}) mixed with host memory ({where}) in one op; "
                "pass all of the op's tensors on one device"
            )
        return key


class _Op:
    """One staged op's pipeline (see the module docs): ``issue`` copies out and runs the host op
    part by part, ``finish`` queues the copies back of a point-to-point op and the
    ``epilogues`` (:class:`then`), records the final event and returns the slots; ``after``
    runs an epilogue given after ``finish``."""

    def __init__(self, stager, what, key, ready, parts, start, p2p):
        self.st, self.what, self.key, self.ready = stager, what, key, ready
        self.parts, self.start, self.p2p = parts, start, p2p
        self.epilogues = []
        self.native = None
        self.slots = []

    def issue(self):
        st, dev = self.st, self.st.device
        d2h, h2d = st.streams(self.key)
        deadline = time.monotonic() + _device.TIMEOUT_S
        parts = self.parts
        dev.wait(d2h, self.ready)
        dev.wait(h2d, self.ready)
        sizes = [[0 if v is None else v[0].numel() * v[0].element_size() for v in p] for p in parts]
        need = max(layout(s)[1] for s in sizes)
        nslots = min(SLOTS, len(parts))
        self.slots = [st.pool.take(need) for _ in range(nslots)]
        filled, hosts = [None] * len(parts), [None] * len(parts)

        def fill(k):
            slot = self.slots[k % nslots]
            if slot.released is not None:
                dev.wait(d2h, slot.released)
            offsets, _ = layout(sizes[k])
            bufs = []
            for v, at in zip(parts[k], offsets):
                if v is None:
                    bufs.append(None)
                    continue
                h = slot.view(at, v[0].numel(), v[0].dtype)
                if v[1] and v[0].numel():
                    dev.copy(h, v[0], d2h)
                bufs.append(h)
            hosts[k] = bufs
            filled[k] = dev.record(d2h)

        for k in range(nslots):
            fill(k)
        for k in range(len(parts)):
            dev.host_wait(filled[k], deadline, f"{self.what}: copying part {k} of {len(parts)} to the host")
            if self.p2p:
                self.native = self.start(hosts[k], True)
                self.hosts = hosts[k]
                return
            self.start(hosts[k], False)
            self._copy_back(parts[k], hosts[k], h2d)
            self.slots[k % nslots].released = dev.record(h2d)
            if k + nslots < len(parts):
                fill(k + nslots)

    def _copy_back(self, part, bufs, h2d):
        dev = self.st.device
        for v, h in zip(part, bufs):
            if v is not None and v[2] and v[0].numel():
                dev.copy(v[0], h, h2d)

    def host_done(self):
        return self.native is None or self.native.is_completed()

    def source_rank(self):
        """A receive from any source: its sender's rank once done (``None`` before)."""
        return None if self.native is None else self.native.source_rank()

    def finish(self):
        st, dev = self.st, self.st.device
        _, h2d = st.streams(self.key)
        if self.p2p:
            if self.native is not None:
                self.native.wait()
            self._copy_back(self.parts[0], self.hosts, h2d)
        for fn in self.epilogues:
            with dev.on_stream(h2d):
                fn()
        for v in self.parts[0]:
            if v is not None and v[2]:
                dev.keep(v[0], h2d)
        final = dev.record(h2d)
        st.pool.give(self.slots, final)
        self.slots = []
        return final

    def after(self, fn):
        """``fn`` on the copy stream after everything ``finish`` queued; the new final event."""
        dev = self.st.device
        _, h2d = self.st.streams(self.key)
        with dev.on_stream(h2d):
            fn()
        return dev.record(h2d)
