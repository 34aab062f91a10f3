"""The device interface the staging code is written against, and its real implementation on
``torch.cuda``.

This module owns the question "what does the device let us do": tell a device tensor from a
host one, the caller's current stream, streams and events (record, stream-wait, query,
host-wait with a deadline), asynchronous copies on a stream, pinned host memory and telling the
caching allocator that a stream uses a tensor. It knows nothing about collectives, chunks or
buffers' reuse (``staging.py`` and ``pool.py`` do).

The staging code sees only a :class:`Device`, so the same code runs on CUDA and, in the tests, on a
fake device whose streams run late on threads of their own (``tests/_fake_device.py``): a staging
bug that reads a buffer too early, reuses one too early or forgets a stream wait then gives a wrong
answer on a CPU machine. :func:`use_device` swaps the device for a test.

What the interface promises (the fake keeps the same promises, no more):

- Work put on one stream runs in order; two streams are unordered unless one waits on an event
  recorded on the other (:meth:`Device.wait`), and waiting on an event orders the stream after
  the work that preceded the event's :meth:`Device.record`, not after anything later.
- :meth:`Device.host_wait` returns only when the event's work is done, or raises
  ``oxcomm.TimeoutError`` at the deadline; :meth:`Device.query` never blocks.
- A copy reads its source and writes its destination at some moment between its enqueueing and
  the completion of an event recorded after it on the same stream: not earlier, not later.
- A thread oxcomm started makes the op's device current (:meth:`Device.use`) before it queues
  work on that device's streams or completes a future of its op: a CUDA thread starts with
  device 0 current, and leaving a stream context switches back to it, which creates a CUDA
  context (~0.5 GB) on GPU 0 in every rank. A caller's thread is left as the caller set it.
- An op's torch future is made by :meth:`Device.future` and completed inside
  :meth:`Device.completing`; then-callbacks of a device op's future run on a stream ordered after
  the result (CUDA: a CUDA-aware future, whose callbacks run on a stream that waits for the
  events recorded when it completed), not on the completing thread's default stream.
"""

from __future__ import annotations

import contextlib
import os
import time

#: Seconds a host thread waits for the device (a copy's event) or for a queued op to be issued
#: before it raises ``oxcomm.TimeoutError``: ``OXCOMM_CUDA_TIMEOUT``, default 300 (the default
#: timeout of ``Communicator.from_store``, so a stuck peer is named by the op before this fires).
TIMEOUT_S = float(os.environ.get("OXCOMM_CUDA_TIMEOUT", "300"))


class Device:
    """What the staging code needs from a device; see the module docs for the promises."""

    name = "device"

    def owns(self, x):
        """Whether ``x`` is a tensor on this device (anything else: ``False``, never an error)."""
        raise NotImplementedError

    def key(self, x):
        """A hashable name of ``x``'s device (one set of staging streams per key)."""
        raise NotImplementedError

    def current_stream(self, key):
        """The calling thread's current stream on device ``key``."""
        raise NotImplementedError

    def new_stream(self, key):
        raise NotImplementedError

    def record(self, stream):
        """A new event recorded on ``stream`` (after the work queued on it so far)."""
        raise NotImplementedError

    def wait(self, stream, event):
        """``stream`` runs nothing more until ``event``'s work is done (the host does not block)."""
        raise NotImplementedError

    def query(self, event):
        raise NotImplementedError

    def host_wait(self, event, deadline, what):
        """Block until ``event``'s work is done, or raise ``oxcomm.TimeoutError`` naming ``what``
        at ``deadline`` (``time.monotonic()`` seconds)."""
        raise NotImplementedError

    def copy(self, dst, src, stream):
        """Queue ``dst.copy_(src)`` on ``stream`` (one side is pinned host memory)."""
        raise NotImplementedError

    def on_stream(self, stream):
        """A context manager under which the calling thread's torch ops go to ``stream``."""
        raise NotImplementedError

    def pinned(self, nbytes):
        """A pinned (page-locked) host tensor of ``nbytes`` bytes (uint8)."""
        raise NotImplementedError

    def host_empty(self, shape, dtype):
        """A host tensor (pageable memory) that oxcomm copies a device tensor into: oxcomm's own
        host tensors come from here or :meth:`pinned` (the tests' fake device, where every other
        CPU tensor is device memory, must know them)."""
        raise NotImplementedError

    def keep(self, x, stream):
        """Tell the allocator that ``stream`` uses ``x`` (so its memory is not reused early)."""
        raise NotImplementedError

    def use(self, key):
        """Make device ``key`` the calling thread's current device (see the module docs)."""
        raise NotImplementedError

    def completing(self, key):
        """A context manager under which the calling thread completes futures of ops on ``key``."""
        raise NotImplementedError

    def future(self, key):
        """A ``torch.futures.Future`` for the result of an op on device ``key``."""
        raise NotImplementedError


def timed_out(what, seconds):
    from .._errors import TimeoutError

    return TimeoutError(
        f"cuda staging: {what}: timed out after {seconds:g}s waiting for the device (OXCOMM_CUDA_TIMEOUT)"
    )


# A host wait polls the event: a blocking synchronize could not give up at the deadline. The
# first polls only yield the GIL (a chunk's copy takes tens of µs); later ones sleep, doubling
# up to _POLL_MAX_S, so a long wait costs little CPU and returns within _POLL_MAX_S of the end.
_POLL_SPINS = 200
_POLL_MAX_S = 50e-6


def poll(query, deadline, what):
    spins = 0
    pause = 1e-6
    while not query():
        if spins < _POLL_SPINS:
            spins += 1
            time.sleep(0)
            continue
        now = time.monotonic()
        if now >= deadline:
            raise timed_out(what, TIMEOUT_S)
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


class TorchCuda(Device):
    """:class:`Device` on ``torch.cuda`` (events without timing, non-blocking copies)."""

    name = "cuda"

    def __init__(self):
        import torch

        self._torch = torch

    def owns(self, x):
        return getattr(x, "is_cuda", False) is True

    def key(self, x):
        return x.device

    def current_stream(self, key):
        return self._torch.cuda.current_stream(key)

    def new_stream(self, key):
        return self._torch.cuda.Stream(device=key)

    def record(self, stream):
        ev = self._torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, event):
        stream.wait_event(event)

    def query(self, event):
        return event.query()

    def host_wait(self, event, deadline, what):
        if not event.query():
            poll(event.query, deadline, what)

    def copy(self, dst, src, stream):
        cuda = self._torch.cuda
        # The device guard first: torch.cuda.stream's exit restores the current device's stream,
        # which on a thread whose current device is another one would make a context there.
        with cuda.device(stream.device), cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    @contextlib.contextmanager
    def on_stream(self, stream):
        cuda = self._torch.cuda
        with cuda.device(stream.device), cuda.stream(stream):
            yield

    def pinned(self, nbytes):
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def host_empty(self, shape, dtype):
        return self._torch.empty(shape, dtype=dtype)

    def keep(self, x, stream):
        x.record_stream(stream)

    def use(self, key):
        cuda = self._torch.cuda
        if cuda.current_device() != key.index:
            cuda.set_device(key)

    @contextlib.contextmanager
    def completing(self, key):
        self.use(key)
        yield

    def future(self, key):
        # CUDA-aware: completing it records events on the current streams of ``key``, and its
        # callbacks (a DDP comm hook's ``then``) run on a stream that waits for them.
        return self._torch.futures.Future(devices=[key])


_REAL = None
#: The device in use; ``None`` until the first call that needs it (importing oxcomm does not
#: import torch).
DEVICE = None
#: True while a test's device is installed: it may claim tensors that look like CPU tensors, so
#: the torch backend's CPU fast path must ask it first.
OVERRIDDEN = False


def device():
    global DEVICE, _REAL
    if DEVICE is None:
        if _REAL is None:
            _REAL = TorchCuda()
        DEVICE = _REAL
    return DEVICE


def owns(x):
    """Whether ``x`` is a tensor on the device in use (CUDA unless a test swapped it)."""
    if DEVICE is None:
        return getattr(x, "is_cuda", False) is True
    return DEVICE.owns(x)


def use_device(dev):
    """Install ``dev`` (``None``: back to CUDA) for the staging code; tests only."""
    global DEVICE, OVERRIDDEN
    DEVICE = dev
    OVERRIDDEN = dev is not None
