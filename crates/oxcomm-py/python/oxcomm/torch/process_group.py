"""The c10d process group behind backend ``"oxcomm"``: torch's calls mapped onto a communicator.

This module owns the two classes torch builds for a group (the group class and the c10d
``Backend`` subclass that serves some devices of a mixed spec) and what they add around the
calls: names, splitting, abort. The rest of the backend is split by question:

| module | owns |
| --- | --- |
| :mod:`.forms` | every call form turned into one normal form, with its checks |
| :mod:`.layout` | a call's tensors as the flat buffers an oxcomm op takes |
| :mod:`.ops` | each call's body: which oxcomm op runs on which buffers, what its Work holds |
| :mod:`.issue` | the order of a group's ops, blocking and async, coalescing regions |
| :mod:`.work` | completion: ``Work``, futures, the waiter thread |

None of them moves bytes, checks peers' sizes or names a peer's errors: the communicator does,
and its exceptions (:class:`oxcomm.OxcommError` and subclasses) reach the caller unchanged.

Ops run in order per group. ``async_op=False`` calls run on the calling thread (the GIL is
released by oxcomm while they wait); ``async_op=True`` calls return at once and fill the
caller's tensors in place when they complete. ``Work.get_future()`` (which DDP uses) is
completed by one waiter thread per group. Torch's coalescing region (``_start_coalescing`` /
``_end_coalescing``, which ``batch_isend_irecv`` opens) holds its isend/irecv back until it
ends, so they start as one batch.

CUDA tensors: every call takes them, with NCCL's stream semantics (the communicator stages them
through pinned host memory: :mod:`oxcomm._cuda`). A call's tensors are all on the device or all
on the host (else ``ValueError`` naming the call); scratch tensors are made on the tensors'
device, and copying out of them after an async op is queued on the device behind the op's
copies (``oxcomm._cuda.staging.then``), so ``Work.wait()`` makes the caller's current stream
wait for the result without blocking the host on the device, and ``get_future()`` completes
when the result is in place on the device.

The group is a ``ProcessGroup`` subclass (every device's calls come to it) when the job's
backend is ``"oxcomm"``; in a spec that gives another device another backend
(``"cpu:gloo,cuda:oxcomm"``) it is a c10d ``Backend`` subclass registered for its devices only,
as torch treats a returned ``ProcessGroup`` as the whole group and would route every device to it.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from . import forms as _forms
from .ops import _Calls
from .work import _done

_c10d = torch._C._distributed_c10d
_C10dBackend = _c10d.Backend

#: The name under which the backend is registered.
BACKEND = "oxcomm"


class _Group(_Calls):
    """What both classes below share beyond the calls: splitting, options and timeout, abort,
    shutdown."""

    @property
    def supports_splitting(self):
        return False

    @property
    def options(self):
        """The group's options as a c10d backend shows them (``options._timeout`` is the
        communicator's timeout, the one every op of the group waits at most)."""
        return _C10dBackend.Options(BACKEND, timeout=timedelta(seconds=self.comm.timeout))

    def _set_default_timeout(self, timeout):
        """The timeout of the group's later ops (torch's ``_set_pg_timeout``, torchft)."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if not seconds > 0:
            raise _forms._bad(self, "_set_default_timeout", f"timeout must be positive, got {timeout!r}")
        self.comm.timeout = seconds

    def abort(self):
        try:
            self.comm.abort("torch.distributed abort")
        except Exception:  # noqa: BLE001 - abort is best effort
            pass

    def shutdown(self):
        pass


class ProcessGroupOxcomm(_Group, dist.ProcessGroup):
    """The group torch builds for backend ``"oxcomm"``: every device's calls come here."""

    def __init__(self, comm, rank, size):
        dist.ProcessGroup.__init__(self, rank, size)
        self._setup(comm)
        self._group_name = ""
        self._group_desc = "undefined"
        self._store = None

    def getBackendName(self):
        return BACKEND

    def _get_backend_name(self):
        return BACKEND

    # A Python group has no C++ backend to keep its name and description: keep them here.
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    @property
    def group_name(self):
        return self._group_name

    @property
    def group_desc(self):
        return self._group_desc

    # torch asks a group's per-device backend for these from Python (batch_isend_irecv,
    # monitored_barrier, object collectives); this group is its own CPU backend.
    def _get_backend(self, device=None):
        return self

    # ------------------------------------------------------------------ split_group

    @property
    def supports_splitting(self):
        return True

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """``torch.distributed.split_group``'s call on the parent: the group of this group's
        ``ranks`` (their order is the new group's rank order) carved out of this group's links
        by its members only (:meth:`oxcomm.Communicator.group`); ``None`` on a rank outside.
        ``timeout``, ``opts`` and ``device_types`` are accepted and unused (the communicator
        keeps the parent's timeout; the group serves every device)."""
        ranks = [int(r) for r in ranks]
        me = self.rank()
        if me not in ranks:
            return None
        comm = self.comm.group(ranks)
        if comm is None or comm.rank != ranks.index(me) or comm.size != len(ranks):
            got = None if comm is None else f"rank {comm.rank} of {comm.size}"
            raise RuntimeError(
                f"oxcomm: split_group {ranks}: torch says rank {ranks.index(me)}, the communicator {got}"
            )
        pg = ProcessGroupOxcomm(comm, comm.rank, comm.size)
        pg.setGroupName(group_name or "")
        pg.setGroupDesc(group_desc or f"{self._group_desc}:split")
        pg._store = dist.PrefixStore(f"oxcomm-split/{group_name}/", self.get_group_store())
        return pg

    def get_group_store(self):
        """The store torch registers a split group with (a prefix of the parent's); the
        parent's own otherwise (as c10d keeps it)."""
        if self._store is not None:
            return self._store
        return dist.distributed_c10d._world.pg_map[self][1]

    @property
    def _device_types(self):
        # torch's flight recorder (attached while the group is built) needs a C++ backend,
        # which a Python group has not; torch skips it for a group that lists no device.
        if sys._getframe(1).f_code.co_name == "_maybe_attach_flight_recorder":
            return []
        return [torch.device("cpu"), torch.device("cuda")]


class BackendOxcomm(_Group, _C10dBackend):
    """oxcomm as the backend of some devices of a group whose other devices have another
    backend (``"cpu:gloo,cuda:oxcomm"``): torch's group routes only those devices' calls here."""

    def __init__(self, comm, rank, size):
        _C10dBackend.__init__(self, rank, size)
        self._setup(comm)

    def getBackendName(self):
        return BACKEND

    def _get_backend_name(self):
        return BACKEND


def python_backends_supported():
    """Whether this torch lets a Python ``Backend`` subclass serve c10d's calls (torch routes a
    call to the subclass's method only if its bindings have a trampoline for ``Backend``; older
    ones call the C++ base, which refuses). Probed once, with a barrier that moves nothing."""
    if _PROBE:
        return _PROBE[0]

    class _Probe(_C10dBackend):
        def barrier(self, opts=None):
            return _done([])

    try:
        _C10dBackend.barrier(_Probe(0, 1), dist.BarrierOptions())
        ok = True
    except Exception:  # noqa: BLE001 - any refusal means "not supported"
        ok = False
    _PROBE.append(ok)
    return ok


_PROBE = []
