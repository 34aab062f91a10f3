"""DeepSpeed's 1-bit compressed all-reduce on torch tensors (CPU and CUDA), over any group.

:class:`CompressedAllreduce` is the calling convention of DeepSpeed's ``compressed_allreduce``
(``buffer_m`` plus the caller's ``worker_error`` and ``server_error`` tensors, updated in
place) over a group that is an :class:`oxcomm.Communicator`, an oxcomm torch process group, or
any other torch process group (gloo, nccl). It is what
:class:`oxcomm.deepspeed.CompressedBackend` and the optimizers of :mod:`oxcomm.optim` call.

    ar = oxcomm.onebit_torch.CompressedAllreduce(group)       # group: as above, or None
    n = oxcomm.onebit_torch.padded_len(x.numel(), ar.size)
    we, se = torch.zeros(n, device=x.device), torch.zeros(n // ar.size, device=x.device)
    y = ar(x, we, se)                                          # ≈ the mean of x over the group

Which path a call takes depends on the tensors' device and on the group's backend for it:

=====================  ===============================  =====================================
tensors                group's backend for the device   path
=====================  ===============================  =====================================
CPU                    oxcomm                           the Rust crate's (:mod:`oxcomm.onebit`)
CPU                    any other (gloo, ...)            device kernels, bytes through
                                                        ``torch.distributed`` on the group
CUDA                   oxcomm                           device kernels, bytes staged through
                                                        pinned host buffers to the communicator
CUDA                   gloo                             the same staging, gloo on CPU bytes
CUDA                   nccl (any other)                 device kernels, bytes through
                                                        ``torch.distributed`` on the device
=====================  ===============================  =====================================

The device kernels (:mod:`oxcomm._onebit_kernels`) compress, average and unpack on the
tensors' device; the error tensors never leave it. Only packed signs and scales cross PCIe
and the wire: two collectives per call, an all-to-all of ``n`` rows and an all-gather of one
row, each row ``C/8`` sign bytes and a 4-byte f32 scale (``C = N / n``), the Rust crate's
wire format. Every path gives the same bits for the same inputs (the sign bytes, and so the
output; the scales and errors up to the rare f32 rounding case described in
:mod:`oxcomm._onebit_kernels`). Every rank of a group must pass tensors on the same kind of
device: over TCP links the Rust path sends large calls' rows point to point rather than in
the two collectives (the crate's ``OneBitState::with_overlap``), so a CPU rank and a CUDA
rank do not mix.

Stream semantics on CUDA are NCCL's: the call reads ``buffer_m`` and the errors after the
work already queued on the current stream, and everything it writes is queued on that
stream, so later work on it sees the result. Staging makes the host wait for the packed
bytes (``C/8 + 4`` per row) before each host collective; the call returns once the last
host-to-device copy is queued.

This module owns the argument checks, the choice of path, the transports of the packed bytes
and their reused buffers (one set per padded length and device). It does not own the error
tensors: the caller does, as in DeepSpeed.
"""

from __future__ import annotations

import math
import time
import weakref

import torch

import oxcomm
from oxcomm import _onebit_kernels as kernels
from oxcomm._cuda import device as _dev

__all__ = ["CompressedAllreduce", "padded_len"]


def padded_len(numel, size):
    """DeepSpeed's padded length for ``numel`` elements on ``size`` ranks: ``numel`` rounded
    up to a multiple of ``size · lcm(size, 8)`` (16 for 2 ranks, 72 for 3, 32 for 4)."""
    if size < 1:
        raise ValueError(f"padded_len: the group size must be at least 1, got {size}")
    multiple = size * (size // math.gcd(size, 8) * 8)
    return -(-int(numel) // multiple) * multiple


def _check(name, t, flat=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compressed_allreduce: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"compressed_allreduce: {name} is {t.dtype}; the 1-bit all-reduce takes float32")
    if flat and (t.dim() != 1 or not t.is_contiguous()):
        raise ValueError(f"compressed_allreduce: {name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")


# ------------------------------------------------------------------------------ transports
#
# A transport runs the call's two collectives on uint8 tensors of one device: ``all_to_all``
# (row j of ``send`` to rank j, row i of ``recv`` from rank i) and ``all_gather`` (``row``
# from every rank into the rows of ``out``, in rank order). Both return when the bytes are in
# place for work queued after them (on CUDA: on the current stream).


class _OxcommBytes:
    """An oxcomm communicator on CPU tensors."""

    def __init__(self, comm):
        self.comm = comm

    def all_to_all(self, send, recv):
        self.comm.all_to_all(send.view(-1), recv.view(-1))

    def all_gather(self, row, out):
        self.comm.all_gather(row.reshape(-1), out.view(-1))


class _TorchBytes:
    """``torch.distributed`` on a process group, on the tensors' own device. gloo takes the
    list form of the all-gather (``all_gather_into_tensor`` is missing from older gloo)."""

    def __init__(self, group, list_gather):
        self.group = group
        self.list_gather = list_gather

    def all_to_all(self, send, recv):
        import torch.distributed as dist

        dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group)

    def all_gather(self, row, out):
        import torch.distributed as dist

        if self.list_gather:
            dist.all_gather(list(out.unbind(0)), row.reshape(-1), group=self.group)
        else:
            dist.all_gather_into_tensor(out.view(-1), row.reshape(-1), group=self.group)


class _Staged:
    """Another transport's collectives on host copies of device tensors.

    The packed bytes are copied device-to-host into pinned buffers (reused: one pair per
    shape) on the current stream, the host waits for that copy (an event recorded after it, so
    everything queued before it is done), the collective runs on the host buffers, and the
    result is copied back host-to-device on the current stream without waiting. Before a host
    buffer is written again, the host waits for the last copy out of it. The device is
    ``oxcomm._cuda.device``'s (CUDA, or the tests' fake device); on host tensors the same
    steps run with plain copies (the tests use this to run the staging logic)."""

    def __init__(self, inner):
        self.inner = inner
        self._host = {}
        self._last_upload = None

    def all_to_all(self, send, recv):
        self._run(self.inner.all_to_all, "all_to_all", send, recv)

    def all_gather(self, row, out):
        self._run(self.inner.all_gather, "all_gather", row.reshape(1, -1), out)

    def _buffers(self, op, send, recv, dev):
        key = (op, tuple(send.shape), tuple(recv.shape))
        bufs = self._host.get(key)
        if bufs is None:
            if dev is None:
                bufs = tuple(torch.empty(t.shape, dtype=torch.uint8) for t in (send, recv))
            else:
                bufs = tuple(dev.pinned(t.numel()).view(t.shape) for t in (send, recv))
            self._host[key] = bufs
        return bufs

    def _run(self, collective, op, send, recv):
        dev = _dev.device() if _dev.owns(send) else None
        host_send, host_recv = self._buffers(op, send, recv, dev)
        if dev is None:
            host_send.copy_(send)
            collective(host_send, host_recv)
            recv.copy_(host_recv)
            return
        what = f"compressed_allreduce: {op}"
        deadline = time.monotonic() + _dev.TIMEOUT_S
        if self._last_upload is not None:
            dev.host_wait(self._last_upload, deadline, f"{what}: the last copy out of the host buffers")
            self._last_upload = None
        stream = dev.current_stream(dev.key(send))
        dev.copy(host_send, send, stream)
        dev.host_wait(dev.record(stream), deadline, f"{what}: copying the packed rows to the host")
        collective(host_send, host_recv)
        dev.copy(recv, host_recv, stream)
        self._last_upload = dev.record(stream)


class _Scratch:
    """The bytes of one call on one device, reused by every call of the same padded length:
    ``send`` (the worker's ``n`` rows, then the server's row in its first), ``recv`` (the rows
    received), and ``inv_n`` (``f32(1/n)`` on the device)."""

    def __init__(self, n, n_padded, device):
        row = n_padded // n // 8 + kernels.SCALE_BYTES
        self.send = torch.empty((n, row), dtype=torch.uint8, device=device)
        self.recv = torch.empty((n, row), dtype=torch.uint8, device=device)
        self.inv_n = kernels.inverse_size(n, device)


def _on(device):
    """The context that makes ``device`` current (Triton launches on the current CUDA device)."""
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _group_backend(group, device_type):
    """The process group's backend object for ``device_type``, or None if it has none."""
    try:
        return group._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError, AttributeError):
        return None


def _backend_name(backend):
    for attr in ("getBackendName", "name", "_get_backend_name"):
        f = getattr(backend, attr, None)
        if callable(f):
            try:
                return str(f())
            except (RuntimeError, TypeError):
                continue
    return type(backend).__name__


class CompressedAllreduce:
    """The 1-bit error-compensated mean over ``group`` (see the module docs for the paths).

    ``group``: an :class:`oxcomm.Communicator`, a torch process group, or None for torch's
    default group. ``rank`` and ``size`` are this rank's and the group's; ``comm`` is the
    oxcomm communicator that serves CPU tensors, None when the group's CPU backend is not
    oxcomm. Constructing it communicates nothing.
    """

    def __init__(self, group=None):
        self.group = group
        self._transports = {}
        self._scratch = {}
        # per (worker_error, server_error) pair on the Rust path: the oxcomm state, weak
        # references to the two tensors and their versions after we last wrote them, so a state
        # is rebuilt when the caller changed them or passes other tensors (a new tensor at a
        # freed one's address has the same key and version 0: only identity tells them apart).
        self._states = {}
        if isinstance(group, oxcomm.Communicator):
            self._torch_group = None
            self.comm = group
            self.rank, self.size = group.rank, group.size
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(
                "compressed_allreduce: no group given and torch.distributed is not initialized "
                "(pass an oxcomm.Communicator or call init_process_group first)"
            )
        g = group if group is not None else dist.distributed_c10d._get_default_group()
        if g == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"compressed_allreduce: rank {dist.get_rank()} is not a member of the group")
        self._torch_group = g
        self.comm = self._oxcomm_of(_group_backend(g, "cpu"))
        self.rank, self.size = dist.get_rank(g), dist.get_world_size(g)

    @staticmethod
    def _oxcomm_of(backend):
        """The communicator of an oxcomm c10d backend (its ``comm``), else None (asked of the
        object, not of :mod:`oxcomm.torch`'s classes: this module sits below that package)."""
        comm = getattr(backend, "comm", None)
        return comm if isinstance(comm, oxcomm.Communicator) else None

    def _transport(self, device, staged=None):
        """The transport for tensors on ``device``: None for the Rust path (CPU tensors on an
        oxcomm group), else one of the transports above. ``staged``: whether they are device
        tensors (``oxcomm._cuda.device`` owns them; default: ``device`` is CUDA)."""
        kind = "cuda" if (device.type == "cuda" if staged is None else staged) else device.type
        if kind in self._transports:
            return self._transports[kind]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"compressed_allreduce: tensors on {device} are not supported (CPU and CUDA are)")
        if self._torch_group is None:
            transport = None if kind == "cpu" else _Staged(_OxcommBytes(self.comm))
        else:
            backend = _group_backend(self._torch_group, kind)
            comm = self._oxcomm_of(backend)
            if comm is None and backend is None and kind == "cuda":
                # no backend for CUDA tensors: their bytes go through the CPU one
                backend = _group_backend(self._torch_group, "cpu")
                comm = self._oxcomm_of(backend)
                if backend is None:
                    raise ValueError("compressed_allreduce: the group has no backend for CPU or CUDA tensors")
                transport = _Staged(_OxcommBytes(comm) if comm else _TorchBytes(self._torch_group, True))
            elif comm is not None:
                transport = None if kind == "cpu" else _Staged(_OxcommBytes(comm))
            else:
                gloo = _backend_name(backend).lower() == "gloo"
                transport = _TorchBytes(self._torch_group, list_gather=gloo)
                if gloo and kind == "cuda":
                    transport = _Staged(transport)
        self._transports[kind] = transport
        return transport

    def __call__(self, buffer_m, worker_error, server_error):
        """DeepSpeed's ``compressed_allreduce``: the 1-bit error-compensated mean of
        ``buffer_m`` over the group, with this rank's ``worker_error`` (1-D float32 of length
        ``N``, ``N % (8·size) == 0``, ``N >= buffer_m.numel()``) and ``server_error`` (``N /
        size``) updated in place; all three on one device (CPU or CUDA). Returns the result
        with ``buffer_m``'s shape; as in DeepSpeed, ``buffer_m`` itself holds it when it is
        contiguous with exactly ``N`` elements, and is left untouched otherwise. An empty
        ``buffer_m`` zeroes both errors and is returned unchanged, with no communication
        (DeepSpeed's ``check_and_handle_empty_buffer``). Collective over the group."""
        _check("buffer_m", buffer_m)
        _check("worker_error", worker_error, flat=True)
        _check("server_error", server_error, flat=True)
        device = buffer_m.device
        for name, t in (("worker_error", worker_error), ("server_error", server_error)):
            if t.device != device:
                raise ValueError(
                    f"compressed_allreduce: rank {self.rank}: {name} is on {t.device} but buffer_m on {device}"
                )
        transport = self._transport(device, _dev.owns(buffer_m))
        shape = buffer_m.shape
        length = buffer_m.numel()
        n_padded = worker_error.numel()
        if length == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        n = self.size
        if n_padded % (8 * n) != 0:
            raise ValueError(
                f"compressed_allreduce: worker_error has {n_padded} elements, not a multiple of 8 × {n} ranks"
            )
        if server_error.numel() != n_padded // n:
            raise ValueError(
                f"compressed_allreduce: server_error has {server_error.numel()} elements, expected {n_padded} / {n}"
            )
        if length > n_padded:
            raise ValueError(
                f"compressed_allreduce: buffer_m has {length} elements, more than worker_error's {n_padded}"
            )
        in_place = length == n_padded and buffer_m.is_contiguous()
        if transport is None:
            return self._rust_call(buffer_m, worker_error, server_error, in_place, shape)
        with torch.no_grad(), _on(device):
            out = buffer_m.view(-1) if in_place else torch.empty(length, dtype=torch.float32, device=device)
            self._kernel_call(transport, buffer_m.reshape(-1), worker_error, server_error, out)
        return buffer_m if in_place else out.view(shape)

    def _kernel_call(self, transport, x, worker_error, server_error, out):
        """The device path: kernels on the tensors' device, bytes through ``transport``."""
        key = (worker_error.numel(), worker_error.device)
        s = self._scratch.get(key)
        if s is None:
            s = self._scratch[key] = _Scratch(self.size, worker_error.numel(), worker_error.device)
        kernels.worker_step(x, worker_error, s.send)
        transport.all_to_all(s.send, s.recv)
        kernels.server_step(s.recv, s.inv_n, server_error, s.send[:1])
        transport.all_gather(s.send[0], s.recv)
        kernels.unpack_rows(s.recv, out)

    def _rust_call(self, buffer_m, worker_error, server_error, in_place, shape):
        """The Rust crate's path (CPU tensors on an oxcomm communicator)."""
        state = self._state(worker_error, server_error)
        buf = buffer_m.view(-1) if in_place else buffer_m.reshape(-1).clone()
        oxcomm.onebit.all_reduce(self.comm, buf, state)
        state.errors_into(worker_error, server_error)
        self._states[_key(worker_error, server_error)] = (
            state,
            weakref.ref(worker_error),
            weakref.ref(server_error),
            worker_error._version,
            server_error._version,
        )
        return buffer_m if in_place else buf.view(shape)

    def _state(self, worker_error, server_error):
        key = _key(worker_error, server_error)
        cached = self._states.get(key)
        if (
            cached is not None
            and cached[1]() is worker_error
            and cached[2]() is server_error
            and cached[3] == worker_error._version
            and cached[4] == server_error._version
        ):
            return cached[0]
        return oxcomm.onebit.State.from_errors(worker_error, server_error, self.comm)


def _key(worker_error, server_error):
    return (worker_error.data_ptr(), worker_error.numel(), server_error.data_ptr(), server_error.numel())
