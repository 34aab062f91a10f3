"""Issue order and completion of staged ops: the lane thread and the Work handles it returns.

This module owns *when* a staged op's host part runs. A communicator sees ops in the order the
caller issued them, on every rank alike, or ranks pair the wrong ops. An async op on device
tensors cannot run its host collective at call time (the device has not copied its input out
yet), so it is queued on the communicator's :class:`Lane`, one thread that runs queued jobs in
issue order; while anything is queued there, every later op of that communicator (host tensors
included) is queued behind it. When the lane is idle, ops run on the calling thread as before.

A job is a :class:`DeviceJob` (staging's pipeline, given as two callables: ``issue`` runs on the
lane, ``finish`` after it) or a :class:`HostJob` (an op on host memory, issued async on the lane).
Both are the Work an async op returns, with the native Work's methods:

- ``wait(timeout=None)``: NCCL's semantics for device ops. The host blocks only until the op's
  last copy is *queued*, then the caller's current stream waits for it; work queued later on
  that stream sees the result. Raises the op's error. ``False`` if ``timeout`` passed first.
- ``synchronize(timeout=None)``: the host blocks until the result is in place on the device.
- ``is_completed()``: true once the result is in place (or the op failed).
- ``get_future()``: a ``concurrent.futures.Future`` completed when the result is in place.

It knows nothing about buffers, chunks or collectives.
"""

from __future__ import annotations

import collections
import threading
import time

from . import device as _device


def _deadline(timeout):
    return time.monotonic() + (_device.TIMEOUT_S if timeout is None else float(timeout))


class Lane:
    """One thread per communicator that runs queued jobs in issue order (started on first use)."""

    def __init__(self, name):
        self._name = name
        self._queue = collections.deque()
        self._cv = threading.Condition()
        self._thread = None
        self._busy = False

    def idle(self):
        """Nothing queued or running. Lock-free: ``_busy`` is set before a job leaves the queue
        and cleared after it ran, so one of the two shows it."""
        return not self._busy and not self._queue

    def submit(self, job):
        with self._cv:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"oxcomm-cuda-{self._name}", daemon=True)
                self._thread.start()
            self._cv.notify()

    def drain(self, what):
        """Block until every job queued so far has been issued (before an op with no async form)."""
        if not self.idle():
            job = HostJob(lambda _bufs, _a: None, [], what)
            self.submit(job)
            job.wait()

    def _run(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                self._busy = True
                job = self._queue.popleft()
            job.run()
            with self._cv:
                self._busy = False


class _Job:
    """What both kinds of job share: the ``issued`` flag and the error."""

    def __init__(self, what):
        self.what = what
        self._issued = threading.Event()
        self._error = None

    def _wait_issued(self, timeout):
        if self._issued.is_set():
            return True
        limit = _device.TIMEOUT_S if timeout is None else float(timeout)
        if self._issued.wait(limit):
            return True
        if timeout is None:
            raise _device.timed_out(f"{self.what}: waiting for the ops queued before it", limit)
        return False

    def exception(self):
        if not self.is_completed():
            return None
        return self._error

    def get_future(self):
        from .._futures import future_of

        return future_of(self, wait=self.synchronize)


class HostJob(_Job):
    """An op on host buffers queued behind device jobs: ``start(bufs, async_op)`` is called on
    the lane with ``async_op=True`` (``False`` for an op with no async form, which then blocks
    the lane until it is done)."""

    def __init__(self, start, bufs, what, has_async=True):
        super().__init__(what)
        self._start, self._bufs, self._async = start, bufs, has_async
        self._native = None

    def run(self):
        try:
            self._native = self._start(self._bufs, self._async)
        except BaseException as e:  # noqa: BLE001 - raised to whoever waits
            self._error = e
        self._start = self._bufs = None
        self._issued.set()

    def wait(self, timeout=None):
        if not self._wait_issued(timeout):
            return False
        if self._error is not None:
            raise self._error
        if self._native is not None:
            return self._native.wait() if timeout is None else self._native.wait(timeout)
        return True

    synchronize = wait

    def is_completed(self):
        if not self._issued.is_set():
            return False
        return self._error is not None or self._native is None or self._native.is_completed()

    def source_rank(self):
        """The sender's rank, once a receive from any source completed (else ``None``)."""
        return None if self._native is None else self._native.source_rank()


class DeviceJob(_Job):
    """A staged op. ``issue()`` runs on the lane (or the calling thread): it copies the inputs out
    and runs or starts the host op. ``finish()`` queues the copies back and returns the event
    after them; it runs right after ``issue`` unless ``deferred`` is given (point-to-point ops: a
    receive completes when the peer sends, and the lane must not wait for that): then the first
    ``wait``/``synchronize`` runs it, or ``is_completed`` once ``deferred()`` says that the host
    op is done (so ``finish`` will not block)."""

    def __init__(self, device, key, what, issue, finish, deferred=None, source=None):
        super().__init__(what)
        self._device, self._key = device, key
        self._issue, self._finish = issue, finish
        self._deferred = deferred
        self._source = source
        self._final = None
        self._lock = threading.Lock()

    def run(self):
        try:
            self._issue()
            if self._deferred is None:
                self._final = self._finish()
                self._finish = None
        except BaseException as e:  # noqa: BLE001 - raised to whoever waits
            self._error = e
        self._issue = None
        self._issued.set()

    def _finished(self):
        """The event after the op's last copy (running a deferred ``finish`` once), or raise."""
        if self._error is not None:
            raise self._error
        if self._final is None:
            with self._lock:
                if self._error is None and self._final is None:
                    try:
                        self._final = self._finish()
                    except BaseException as e:  # noqa: BLE001
                        self._error = e
                    self._finish = None
            if self._error is not None:
                raise self._error
        return self._final

    def wait(self, timeout=None):
        if not self._wait_issued(timeout):
            return False
        final = self._finished()
        self._device.wait(self._device.current_stream(self._key), final)
        return True

    def synchronize(self, timeout=None):
        if not self._wait_issued(timeout):
            return False
        self._device.host_wait(self._finished(), _deadline(timeout), self.what)
        return True

    def is_completed(self):
        if not self._issued.is_set():
            return False
        if self._error is not None:
            return True
        if self._final is None:
            if self._deferred is None or not self._deferred():
                return False
            try:
                self._finished()
            except BaseException:  # noqa: BLE001 - completed, with an error
                return True
        return self._device.query(self._final)

    def source_rank(self):
        """The sender's rank, once a receive from any source completed (else ``None``)."""
        return None if self._source is None else self._source()
