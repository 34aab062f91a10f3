"""torch ``Work`` objects for oxcomm ops, and the per-group thread that completes them.

This module owns completion: an async oxcomm op becomes an :class:`_Op` queued on its group's
:class:`_Waiter`, whose thread waits for the ops in issue order and completes their torch
futures; :class:`_Work` is what torch hands the caller. It does not issue ops or decide their
order (:mod:`.issue` issues them, and the communicator's lane, ``oxcomm._cuda.work``, orders
them) nor know which device a tensor is on: an op on device tensors hands it a staged Work
(``oxcomm._cuda.work``), whose ``synchronize`` the waiter blocks on (the future completes when
the result is in place on the device) and whose ``wait`` the caller's ``Work.wait()`` calls
(the caller's current stream waits; the host does not wait for the device). A device op's
future is the device's (``Device.future``: CUDA-aware on CUDA, so that its then-callbacks, a
DDP comm hook's, run on a stream ordered after the result), completed by the waiter with the
op's device current (``Device.completing``).
"""

from __future__ import annotations

import collections
import threading

import contextlib

import torch
import torch.distributed as dist

from oxcomm._cuda import device as _dev


class _Op:
    """One async oxcomm op: its native Work, the tensors its future holds (the outputs, as
    gloo's works hold) and ``finish``, which runs once after completion (copies out of
    scratch buffers) before anyone sees the result. ``key``: the device of a device op's
    tensors (None for a host op)."""

    __slots__ = ("native", "result", "finish", "future", "name", "key")

    def __init__(self, native, result, finish, future, name, key=None):
        self.native, self.result, self.finish, self.future, self.name = native, result, finish, future, name
        self.key = key

    def complete(self):
        where = contextlib.nullcontext() if self.key is None else _dev.device().completing(self.key)
        with where:
            try:
                getattr(self.native, "synchronize", self.native.wait)()
                if self.finish is not None:
                    self.finish()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                self.future.set_exception(e)
            else:
                self.future.set_result(self.result)
        self.native = None


class _Waiter:
    """One daemon thread per group that waits for its async ops in issue order and completes
    their torch futures (a torch Work from a Python backend reports completion only through
    its future)."""

    def __init__(self):
        self._queue = collections.deque()
        self._cv = threading.Condition()
        self._thread = None

    def submit(self, op):
        with self._cv:
            self._queue.append(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="oxcomm-torch-waiter", daemon=True)
                self._thread.start()
            self._cv.notify()

    def idle(self):
        """No async op of this group in flight. Lock-free: ``_busy`` is set before an op
        leaves the queue and cleared after it completed, so one of the two shows it."""
        return not self._busy and not self._queue

    _busy = False

    def _run(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                self._busy = True
                op = self._queue.popleft()
            op.complete()
            with self._cv:
                self._busy = False


class _Nothing:
    def wait(self, timeout=None):
        pass


_NOTHING = _Nothing()


class _Work(dist.Work):
    """torch's Work for an oxcomm op: ``wait`` (raises the op's error), ``is_completed``,
    ``get_future`` (a ``torch.futures.Future`` holding the output tensors, as gloo's).
    ``future`` is None for an op that completed before the Work was made. ``device_work``: the
    staged Work of an op on device tensors, whose ``wait`` makes the caller's current stream
    wait for the result (NCCL's ``Work.wait()``), where the future would block the host.
    ``release``: for a point-to-point op, what hands the group's held isend/irecv to the waiter
    (:meth:`.issue._Issuer._release`); waiting on or polling the Work calls it first, as the
    native rule starts pending isend/irecv when a handle is waited on or polled."""

    def __init__(self, result, future=None, device_work=None, source=None, release=None):
        super().__init__()
        self._result = result
        self._future = future
        self._device_work = device_work
        self._source = source
        self._release = release

    def _start(self):
        if self._release is not None:
            self._release()

    def wait(self, timeout=None):
        self._start()
        if self._device_work is not None:
            self._device_work.wait()
            return True
        if self._future is not None:
            self._future.wait()
        return True

    def is_completed(self):
        self._start()
        return self._future is None or self._future.done()

    def is_success(self):
        if not self.is_completed():
            return False
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - the question is only whether it failed
            return False
        return True

    def exception(self):
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def result(self):
        self.wait()
        return self._result

    def _source_rank(self):
        """A receive from any source: the sender's rank in the group, after waiting for it
        (torch's ``recv`` calls this); any other op raises, as torch's works do."""
        if self._source is None:
            raise RuntimeError("oxcomm: _source_rank: this Work is not a receive from any source")
        self.wait()
        if self._future is not None:
            self._future.wait()  # the op's own completion (the device wait only queues it)
        return self._source()

    source_rank = _source_rank

    def get_future(self):
        self._start()
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._result)
        return self._future


def _done(result):
    """A completed Work whose future holds ``result``."""
    return _Work(result)


class _Done(_Work):
    """The one finished Work that every blocking call returns (torch only calls ``wait`` on
    it): ``wait`` returns at once, without reading the attributes a pending Work needs
    (0.13 -> 0.03 µs a call, thread CPU time; docs/perf_torch_path.md)."""

    def wait(self, timeout=None):
        return True


_DONE = _Done([])
