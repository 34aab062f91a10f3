"""Issuing a group's ops in order: the one path every op body of :mod:`.ops` goes through.

This module owns the issuing of a group's ops: a blocking call runs on the calling thread when no
async op of the group is in flight, else behind them; async ops go to the group's waiter
(:mod:`.work`) in issue order, which completes them; device ops queue their copies out behind
the op (:mod:`oxcomm._cuda.staging`). The order itself is the communicator's: every op reaches
it through its lane when one is in use (``oxcomm._cuda.work``), so a call that goes straight to
the native communicator (the blocking all-reduce's fast path) checks that lane too (:meth:`_idle`).

Point-to-point ops are held back from the waiter (it would wait on them, and the native rule
starts pending isend/irecv as one batch when one is waited on: an isend waited on before its
irecv is issued would start alone, and two ranks that each send a message larger than the ring
before they receive would block in it). They go to the waiter when the caller waits on or polls
one of them, when another op is issued, when a coalescing region torch opened
(``batch_isend_irecv``) ends, or before an op with no async form. It does not know what an op
computes or which arguments it takes (:mod:`.ops`, :mod:`.forms`).

The interface with the op bodies: ``_run(call, opts, start, result, finish, device)`` for a
collective (``start(async_op)`` issues the oxcomm op and returns its native Work, or None when
blocking; ``result`` is what the Work's future holds; ``finish`` runs once after completion),
``_p2p(...)`` for a point-to-point op, ``_drain()`` before an op with no async form.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from oxcomm._cuda import device as _dev
from oxcomm._cuda import staging as _staging

from .work import _DONE, _NOTHING, _done, _Op, _Waiter, _Work


def _last(works, asynchronous):
    """The native Work of a call made of several native ops (one per dtype): the one op's
    own, or one that waits for each (raising the first error)."""
    if not asynchronous:
        return None
    return works[0] if len(works) == 1 else _AllNative(works)


class _AllNative:
    """Native-like Work over several native Works (``wait``; ``synchronize`` where they have it)."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        return True

    def synchronize(self):
        for w in self.works:
            getattr(w, "synchronize", w.wait)()

    @property
    def device_key(self):
        return getattr(self.works[-1], "device_key", None)


class _AllOf:
    """A native-like Work over the futures of a coalescing region's ops: ``wait`` returns when
    all are done and raises the first one's error (the waiter completes them in order, so by
    the time it waits on this they are done)."""

    def __init__(self, futures):
        self.futures = futures

    def wait(self, timeout=None):
        for f in self.futures:
            f.wait()
        return True


class _Issuer:
    """The issue machinery of a group; :class:`.ops._Calls` adds the op bodies on top.

    ``self.comm`` is the group's :class:`oxcomm.Communicator` (rank and size as torch's).
    """

    def _setup(self, comm):
        self.comm = comm
        self._native = comm._c
        self._waiter = _Waiter()
        # The coalescing region torch opened (``_start_coalescing``): None outside one, else
        # every op issued in it.
        self._region = None
        # Point-to-point ops not yet handed to the waiter (see the module docs); a Work's wait
        # on another thread releases them too, hence the lock.
        self._held = []
        self._held_lock = threading.Lock()

    @property
    def supports_coalescing(self):
        # torch opens coalescing regions on the group itself (a ProcessGroup subclass); the
        # c10d Backend subclass of a mixed spec is reached through torch's C++ group instead.
        return isinstance(self, dist.ProcessGroup)

    def _idle(self):
        """No op of this group is in flight, and none queued on the communicator's lane: a
        blocking call may go straight to the native communicator."""
        st = self.comm._st
        return self._waiter.idle() and (st is None or st.lane.idle())

    def _run(self, op, opts, start, result, finish=None, device=False):
        """Issue the oxcomm op ``start(async_op)`` and return torch's Work for it.

        A blocking call (``opts.asyncOp`` false) runs here, unless an earlier async op of this
        group is still in flight: then it is issued async behind it and waited, so that oxcomm
        sees ops in the order torch issued them. ``device``: the op's tensors are device
        tensors (then ``finish`` of an async op is queued on the device behind the op, and the
        Work's ``wait`` has NCCL's stream semantics).
        """
        asynchronous = opts is None or getattr(opts, "asyncOp", True)
        if not asynchronous and self._waiter.idle():
            # (on device tensors, the op returns with the caller's current stream waiting for
            # it, so ``finish`` queued now on that stream runs after it)
            start(False)
            if finish is not None:
                finish()
            # torch's blocking calls only wait() on it: one completed Work serves them all.
            return _DONE
        if device:
            with _staging.then(finish):
                native = start(True)
            key = native.device_key
            fut = _dev.device().future(key)
            self._submit(_Op(native, result, None, fut, op, key))
            work = _Work(result, fut, native)
            if not asynchronous:
                work.wait()
            return work
        try:
            native = start(True)
        except (TypeError, NotImplementedError) as e:
            if "async" not in str(e):
                raise
            # an op oxcomm runs only blocking: behind the in-flight ones, then here
            self._drain()
            start(False)
            if finish is not None:
                finish()
            return _done(result)
        fut = torch.futures.Future()
        self._submit(_Op(native, result, finish, fut, op))
        work = _Work(result, fut)
        if not asynchronous:
            work.wait()
        return work

    def _drain(self):
        """Wait until this group's async ops are done (before an op that has no async form)."""
        self._release()
        if not self._waiter.idle():
            fut = torch.futures.Future()
            self._waiter.submit(_Op(_NOTHING, [], None, fut, "drain"))
            fut.wait()

    def _p2p(self, name, start, result, finish, device, any_source=False):
        key = None
        if device:
            # the copy out of a scratch tensor goes on the device behind the op's own copies
            with _staging.then(finish):
                native = start()
            finish = None
            key = native.device_key
            fut = _dev.device().future(key)
        else:
            native = start()
            fut = torch.futures.Future()
        self._submit(_Op(native, result, finish, fut, name, key), batch=True)
        source = native.source_rank if any_source else None
        return _Work(result, fut, native if device else None, source, release=self._release)

    def _submit(self, op, batch=False):
        """Hand ``op`` to the waiter; hold a point-to-point op (``batch``) back until the held
        ones are released (see the module docs), and release them before any other op."""
        if self._region is not None:
            self._region.append(op)
        with self._held_lock:
            if batch:
                self._held.append(op)
                return
            self._release_held()
            self._waiter.submit(op)

    def _release(self):
        if self._held:
            with self._held_lock:
                self._release_held()

    def _release_held(self):
        held, self._held = self._held, []
        for op in held:
            self._waiter.submit(op)

    def _start_coalescing(self, device=None):
        """torch's ``_coalescing_manager`` (and ``batch_isend_irecv``) opens a region: the
        isend/irecv issued in it run as one oxcomm batch; its all_reduce,
        all_gather_into_tensor and reduce_scatter_tensor calls reach this group as one
        ``*_coalesced`` call (torch gathers them)."""
        if self._region is not None:
            raise RuntimeError("oxcomm: _start_coalescing: a coalescing region is already open on this group")
        self._region = []

    def _end_coalescing(self, device=None):
        """Close the region: its held point-to-point ops start (one batch) and the Work
        returned completes when every op of the region has (torch keeps only this Work)."""
        ops, self._region = self._region, None
        if ops is None:
            raise RuntimeError("oxcomm: _end_coalescing without _start_coalescing")
        self._release()
        if not ops:
            return _done([])
        fut = torch.futures.Future()
        self._waiter.submit(_Op(_AllOf([o.future for o in ops]), [], None, fut, "coalesced"))
        return _Work([], fut)

