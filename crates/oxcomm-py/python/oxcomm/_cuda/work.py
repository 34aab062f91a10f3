"""Issue order and completion of staged ops: the lane thread and the Work handles it returns.

This module owns *when* a staged op's host part runs. A communicator sees ops in the order the
caller issued them, on every rank alike, or ranks pair the wrong ops. An async op on device
tensors cannot run its host collective at call time (the device has not copied its input out
yet), so it is queued on the communicator's :class:`Lane`, one thread that runs queued jobs in
issue order; while anything is queued there, every later op of that communicator (host tensors
included, and the torch backend's blocking fast path) is queued behind it. When the lane is
idle, ops run on the calling thread as before. The lane is the communicator's one issue order:
the torch backend's waiter thread (``oxcomm.torch.work``) only completes futures, in that order.

A job is a :class:`DeviceJob` (a staged op: ``staging._Op``, whose ``issue`` runs on the lane and
``finish`` after it) or a :class:`HostJob` (an op on host memory, issued async on the lane).
Both are the Work an async op returns, with the native Work's methods:

- ``wait(timeout=None)``: NCCL's semantics for device ops. The host blocks only until the op's
  last copy is *queued*, then the caller's current stream waits for it; work queued later on
  that stream sees the result. Raises the op's error. ``False`` if ``timeout`` passed first.
- ``synchronize(timeout=None)``: the host blocks until the result is in place on the device.
- ``is_completed()``: true once the result is in place (or the op failed).
- ``get_future()``: a ``concurrent.futures.Future`` completed when the result is in place.

Point-to-point jobs follow the native rule that pending isend/irecv start together, as one
batch, when a handle is waited on or polled: a staged isend or irecv is issued natively on the
lane (after its copy out), and its Work, when waited on or polled, first lets the lane issue
every job queued before that call, so that the isend and irecv the caller issued start as one
batch. (Waiting on a lone isend whose irecv is still queued would start it alone, and two ranks
that each send before they receive a message larger than the ring would both block in it.)

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
    """One thread per communicator that runs queued jobs in issue order (started on first use).
    ``submitted`` counts the jobs ever queued, ``issued`` those that ran."""

    def __init__(self, name):
        self._name = name
        self._queue = collections.deque()
        self._cv = threading.Condition()
        self._thread = None
        self._busy = False
        self.submitted = 0
        self.issued = 0

    def idle(self):
        """Nothing queued or running. Lock-free: ``_busy`` is set before a job leaves the queue
        and cleared after it ran, so one of the two shows it."""
        return not self._busy and not self._queue

    def submit(self, job):
        with self._cv:
            self._queue.append(job)
            self.submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"oxcomm-cuda-{self._name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def issued_upto(self, n, deadline, what):
        """Block until the first ``n`` jobs ever queued have run (been issued)."""
        if self.issued >= n:
            return
        with self._cv:
            while self.issued < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _device.timed_out(f"{what}: waiting for the ops queued before it", _device.TIMEOUT_S)
                self._cv.wait(left)

    def drain(self, what):
        """Block until every job queued so far has been issued (before an op with no async form)."""
        if not self.idle():
            self.issued_upto(self.submitted, _deadline(None), what)

    def _run(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                self._busy = True
                job = self._queue.popleft()
            job.run(on_lane=True)
            with self._cv:
                self._busy = False
                self.issued += 1
                self._cv.notify_all()


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
    the lane until it is done). ``lane``: for an isend or irecv, the lane, whose jobs queued
    before a wait or poll are issued first (see the module docs)."""

    #: Not a device op (the torch backend completes its future as a host op's).
    device_key = None

    def __init__(self, start, bufs, what, has_async=True, lane=None):
        super().__init__(what)
        self._start, self._bufs, self._async = start, bufs, has_async
        self._lane = lane
        self._native = None

    def run(self, on_lane=False):
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
            if self._lane is not None:
                self._lane.issued_upto(self._lane.submitted, _deadline(timeout), self.what)
            return self._native.wait() if timeout is None else self._native.wait(timeout)
        return True

    synchronize = wait

    def is_completed(self):
        if not self._issued.is_set():
            return False
        if self._error is not None or self._native is None:
            return True
        if self._lane is not None and self._lane.issued < self._lane.submitted:
            return False
        return self._native.is_completed()

    def source_rank(self):
        """The sender's rank, once a receive from any source completed (else ``None``)."""
        return None if self._native is None else self._native.source_rank()


class DeviceJob(_Job):
    """A staged op (``op``: ``staging._Op``). ``run`` (on the lane, or on the calling thread for
    a blocking op when the lane is idle) copies the inputs out and runs or starts the host op,
    then, except for a point-to-point op, queues the copies back (``op.finish``), which gives
    the event after the op's last copy. A point-to-point op finishes later, when its Work is
    first waited on or polled after its host op is done (a receive completes when the peer
    sends, and the lane must not wait for that). ``device_key``: the device of its tensors."""

    def __init__(self, device, key, what, op, lane):
        super().__init__(what)
        self._device, self._op, self._lane = device, op, lane
        self.device_key = key
        self._final = None
        self._finished = False
        self._lock = threading.Lock()

    def run(self, on_lane=False):
        try:
            if on_lane:
                self._device.use(self.device_key)
            self._op.issue()
            if not self._op.p2p:
                self._finish()
        except BaseException as e:  # noqa: BLE001 - raised to whoever waits
            self._error = e
        self._issued.set()

    def _finish(self):
        with self._lock:
            if not self._finished:
                self._finished = True
                self._final = self._op.finish()
        return self._final

    def then(self, fn):
        """Run ``fn`` on the device after the op's copies back, before its completion (its torch
        ops go to the copy stream): ``staging.then`` calls it for the last op of its block."""
        with self._lock:
            if not self._finished:
                self._op.epilogues.append(fn)
                return
            if self._error is None:
                self._final = self._op.after(fn)

    def _settle(self, deadline):
        """The event after the op's last copy (finishing a point-to-point op once), or raise."""
        if self._error is not None:
            raise self._error
        if self._final is None:
            if self._op.p2p:
                # every op queued before this call issued first: the pending isend/irecv start
                # together (see the module docs)
                self._lane.issued_upto(self._lane.submitted, deadline, self.what)
            try:
                self._finish()
            except BaseException as e:  # noqa: BLE001
                self._error = e
                raise
        return self._final

    def wait(self, timeout=None):
        if not self._wait_issued(timeout):
            return False
        final = self._settle(_deadline(timeout))
        self._device.wait(self._device.current_stream(self.device_key), final)
        return True

    def synchronize(self, timeout=None):
        if not self._wait_issued(timeout):
            return False
        deadline = _deadline(timeout)
        self._device.host_wait(self._settle(deadline), deadline, self.what)
        return True

    def is_completed(self):
        if not self._issued.is_set():
            return False
        if self._error is not None:
            return True
        if self._final is None:
            if not self._op.p2p or self._lane.issued < self._lane.submitted or not self._op.host_done():
                return False
            try:
                self._settle(_deadline(None))
            except BaseException:  # noqa: BLE001 - completed, with an error
                return True
        return self._device.query(self._final)

    def get_future(self):
        from .._futures import future_of

        def settle():
            # on the future's own thread: the op's device current first (see device.py)
            self._device.use(self.device_key)
            self.synchronize()

        return future_of(self, wait=settle)

    def source_rank(self):
        """The sender's rank, once a receive from any source completed (else ``None``)."""
        return self._op.source_rank()
