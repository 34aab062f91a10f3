"""The ``torch.distributed`` backend ``"oxcomm"`` and :class:`OnebitAdam`.

Importing this module registers the backend name ``"oxcomm"`` with
``torch.distributed.Backend.register_backend``, so that a CPU training script runs on oxcomm by
changing one word::

    import oxcomm.torch  # noqa: F401  (registers "oxcomm")
    torch.distributed.init_process_group("oxcomm")   # under torchrun or `oxcomm launch`

This module owns the mapping of torch's c10d calls (their option structs, tensor lists and
``Work`` objects) onto an :class:`oxcomm.Communicator`, one communicator per torch process
group, and the 1-bit Adam optimizer. It does not move bytes, check peers' sizes or name
errors: the communicator does, and its exceptions (:class:`oxcomm.OxcommError` and subclasses)
reach the caller unchanged.

Rendezvous goes through the store torch hands the backend (the group's ``PrefixStore``), so
no second port or token is needed. The default group builds its communicator with
:meth:`oxcomm.Communicator.from_store`; a group from ``new_group`` is carved out of the
default group's links with ``comm.group(global_ranks)``, which only the members call, as
torch requires. When the default group is not oxcomm (``init_process_group("gloo")`` then
``new_group(backend="oxcomm")``) the members rendezvous on the new group's own store.

What torch can ask for and oxcomm cannot do raises ``NotImplementedError`` naming the call:
``PREMUL_SUM``, receiving from any source, sparse all-reduce, all-gather/gather/scatter
lists whose tensors differ in shape, and multi-tensor (multi-device) variants of the
single-tensor collectives.

Ops run in order per group. ``async_op=False`` calls run on the calling thread (the GIL is
released by oxcomm while they wait); ``async_op=True`` calls return at once and fill the
caller's tensors in place when they complete. ``Work.get_future()`` (which DDP uses) is
completed by one waiter thread per group.
"""

from __future__ import annotations

import collections
import math
import sys
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

import oxcomm
from oxcomm._buffers import buffer as _buffer

__all__ = ["ProcessGroupOxcomm", "OnebitAdam", "communicator", "BACKEND"]

#: The name under which the backend is registered.
BACKEND = "oxcomm"

# torch's ReduceOp.RedOpType name -> oxcomm's ReduceOp name.
_OPS = {
    "SUM": "SUM",
    "AVG": "AVG",
    "PRODUCT": "PROD",
    "MIN": "MIN",
    "MAX": "MAX",
    "BAND": "BAND",
    "BOR": "BOR",
    "BXOR": "BXOR",
}

_SUM = dist.ReduceOp.SUM

# The communicator of the default group when it is an oxcomm group (global rank == its rank).
_world_comm = None


_op_cache = {}


def _reduce_op(op, call):
    """oxcomm's ReduceOp for a torch ReduceOp (or RedOpType), or NotImplementedError."""
    kind = getattr(op, "op", op)
    hit = _op_cache.get(kind)
    if hit is not None:
        return hit
    name = getattr(kind, "name", str(kind).rsplit(".", 1)[-1])
    if name not in _OPS:
        raise NotImplementedError(
            f"oxcomm: {call} with ReduceOp.{name} is not supported (oxcomm reduces with {', '.join(_OPS)})"
        )
    _op_cache[kind] = found = getattr(oxcomm.ReduceOp, _OPS[name])
    return found


def _timeout(opts):
    """The op's timeout in seconds, or None when torch left it unset (negative)."""
    t = getattr(opts, "timeout", None)
    if isinstance(t, timedelta) and t.total_seconds() > 0:
        return t.total_seconds()
    return None


def _single(tensors, call):
    if len(tensors) != 1:
        raise NotImplementedError(
            f"oxcomm: {call} takes one tensor per rank, got {len(tensors)} (multi-device lists are not supported)"
        )
    return tensors[0]


def _check_cpu(call, *tensors):
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"oxcomm: {call}: tensor on {t.device}; oxcomm reduces CPU tensors only")


def _flat(t):
    """A flat view of a contiguous tensor (no copy)."""
    return t.view(-1) if t.dim() != 1 else t


def _contiguous_out(t, finish):
    """(buffer to write, finish) for an output tensor: the tensor itself when contiguous, else a
    contiguous scratch copied back by ``finish``."""
    if t.is_contiguous():
        return t, finish
    scratch = t.contiguous()

    def copy_back():
        t.copy_(scratch)
        if finish is not None:
            finish()

    return scratch, copy_back


def _adjacent_base(tensors):
    """A flat view over ``tensors`` when they are contiguous, of one dtype and lie back to back
    in one storage (for example ``torch.chunk`` of a buffer), so the op writes them in place."""
    first = tensors[0]
    n = first.numel()
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.numel() == n for t in tensors):
        return None
    try:
        storage = first.untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
            return None
    except (RuntimeError, NotImplementedError):
        return None
    step = n * first.element_size()
    if any(t.data_ptr() != first.data_ptr() + i * step for i, t in enumerate(tensors)):
        return None
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (n * len(tensors),))


def _same_shape(tensors, call):
    shape = tensors[0].shape
    if any(t.shape != shape or t.dtype != tensors[0].dtype for t in tensors):
        raise NotImplementedError(f"oxcomm: {call} with tensors of different shapes or dtypes is not supported")


class _Op:
    """One async oxcomm op: its native Work, the tensors its future holds (the outputs, as
    gloo's works hold) and ``finish``, which runs once after completion (copies out of
    scratch buffers) before anyone sees the result."""

    __slots__ = ("native", "result", "finish", "future", "name")

    def __init__(self, native, result, finish, future, name):
        self.native, self.result, self.finish, self.future, self.name = native, result, finish, future, name

    def complete(self):
        try:
            self.native.wait()
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
    ``future`` is None for an op that completed before the Work was made."""

    def __init__(self, result, future=None):
        super().__init__()
        self._result = result
        self._future = future

    def wait(self, timeout=None):
        if self._future is not None:
            self._future.wait()
        return True

    def is_completed(self):
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

    def get_future(self):
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._result)
        return self._future


def _done(result):
    """A completed Work whose future holds ``result``."""
    return _Work(result)


_DONE = _Work([])


class ProcessGroupOxcomm(dist.ProcessGroup):
    """The c10d backend torch builds for a group created with backend ``"oxcomm"``.

    ``self.comm`` is the group's :class:`oxcomm.Communicator` (rank and size as torch's).
    """

    def __init__(self, comm, rank, size):
        super().__init__(rank, size)
        self.comm = comm
        self._native = comm._c
        self._waiter = _Waiter()
        self._group_name = ""
        self._group_desc = "undefined"

    # ------------------------------------------------------------------ plumbing

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

    @property
    def _device_types(self):
        # torch's flight recorder (attached while the group is built) needs a C++ backend,
        # which a Python group has not; torch skips it for a group that lists no device.
        if sys._getframe(1).f_code.co_name == "_maybe_attach_flight_recorder":
            return []
        return [torch.device("cpu")]

    @property
    def supports_splitting(self):
        return False

    @property
    def supports_coalescing(self):
        return False

    def _run(self, op, opts, start, result, finish=None):
        """Issue the oxcomm op ``start(async_op)`` and return torch's Work for it.

        A blocking call (``opts.asyncOp`` false) runs here, unless an earlier async op of this
        group is still in flight: then it is issued async behind it and waited, so that oxcomm
        sees ops in the order torch issued them.
        """
        asynchronous = opts is None or getattr(opts, "asyncOp", True)
        if not asynchronous and self._waiter.idle():
            start(False)
            if finish is not None:
                finish()
            # torch's blocking calls only wait() on it: one completed Work serves them all.
            return _DONE
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
        self._waiter.submit(_Op(native, result, finish, fut, op))
        work = _Work(result, fut)
        if not asynchronous:
            work.wait()
        return work

    # ------------------------------------------------------------------ reductions

    def allreduce(self, tensors, opts=None):
        # The blocking one-tensor call a training step makes most: straight to the native
        # communicator (each µs here is a µs of every small all-reduce). Anything else, and any
        # tensor the fast checks do not pass, takes the general path below.
        if opts is not None and len(tensors) == 1 and not opts.asyncOp and self._waiter.idle():
            t = tensors[0]
            if t.is_cpu and t.is_contiguous():
                op = opts.reduceOp
                name = "sum" if op == _SUM else _reduce_op(op, "all_reduce").value
                self._native.all_reduce(_buffer(t, "tensor"), name, False)
                return _DONE
        opts = opts or dist.AllreduceOptions()
        op = _reduce_op(opts.reduceOp, "all_reduce")
        _check_cpu("all_reduce", *tensors)
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        buf, finish = _contiguous_out(tensors[0], None)
        return self._run("all_reduce", opts, lambda a: self.comm.all_reduce(buf, op, async_op=a), tensors, finish)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        op = _reduce_op(opts.reduceOp, "all_reduce_coalesced")
        _check_cpu("all_reduce_coalesced", *tensors)
        finish = None
        bufs = []
        for t in tensors:
            b, finish = _contiguous_out(t, finish)
            bufs.append(b)
        return self._run(
            "all_reduce_coalesced",
            opts,
            lambda a: self.comm.all_reduce_coalesced(bufs, op, async_op=a),
            tensors,
            finish,
        )

    def allreduce_sparse(self, tensors, opts=None):
        raise NotImplementedError("oxcomm: all_reduce of sparse tensors is not supported")

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op = _reduce_op(opts.reduceOp, "reduce")
        t = _single(tensors, "reduce")
        _check_cpu("reduce", t)
        buf, finish = _contiguous_out(t, None)
        root = opts.rootRank
        return self._run("reduce", opts, lambda a: self.comm.reduce(buf, root, op, async_op=a), tensors, finish)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        t = _single(tensors, "broadcast")
        _check_cpu("broadcast", t)
        buf, finish = _contiguous_out(t, None)
        root = opts.rootRank
        return self._run("broadcast", opts, lambda a: self.comm.broadcast(buf, root, async_op=a), tensors, finish)

    # ------------------------------------------------------------------ gathers

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        inp = _single(input_tensors, "all_gather").contiguous()
        outs = _single(output_tensors, "all_gather")
        _check_cpu("all_gather", inp, *outs)
        if len(outs) != self.size():
            raise ValueError(f"oxcomm: all_gather: {len(outs)} output tensors for a group of {self.size()}")
        _same_shape(outs, "all_gather")
        flat = _adjacent_base(outs)
        finish = None
        if flat is None:
            flat = torch.empty(inp.numel() * len(outs), dtype=inp.dtype)

            def finish():
                for k, o in enumerate(outs):
                    o.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view(o.shape))

        src = _flat(inp)
        return self._run(
            "all_gather", opts, lambda a: self.comm.all_gather(src, flat, async_op=a), output_tensors, finish
        )

    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        _check_cpu("all_gather_into_tensor", output, input)
        src = _flat(input.contiguous())
        out, finish = _contiguous_out(output, None)
        dst = _flat(out)
        return self._run(
            "all_gather_into_tensor", opts, lambda a: self.comm.all_gather(src, dst, async_op=a), [output], finish
        )

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else _done([])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        works = [self.allgather([o], [i], opts) for o, i in zip(output_lists, inputs)]
        return works[-1] if works else _done([])

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        inp = _single(input_tensors, "gather").contiguous()
        root = opts.rootRank
        finish = None
        flat = None
        if self.rank() == root:
            outs = _single(output_tensors, "gather")
            _check_cpu("gather", inp, *outs)
            if len(outs) != self.size():
                raise ValueError(f"oxcomm: gather: {len(outs)} output tensors for a group of {self.size()}")
            _same_shape(outs, "gather")
            flat = _adjacent_base(outs)
            if flat is None:
                flat = torch.empty(inp.numel() * len(outs), dtype=inp.dtype)

                def finish():
                    for k, o in enumerate(outs):
                        o.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view(o.shape))

        src = _flat(inp)
        return self._run(
            "gather", opts, lambda a: self.comm.gather(src, flat, root, async_op=a), output_tensors, finish
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        out = _single(output_tensors, "scatter")
        root = opts.rootRank
        flat = None
        if self.rank() == root:
            ins = _single(input_tensors, "scatter")
            _check_cpu("scatter", out, *ins)
            if len(ins) != self.size():
                raise ValueError(f"oxcomm: scatter: {len(ins)} input tensors for a group of {self.size()}")
            _same_shape(ins, "scatter")
            flat = _adjacent_base(ins)
            if flat is None:
                flat = torch.cat([_flat(t.contiguous()) for t in ins])
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        return self._run(
            "scatter", opts, lambda a: self.comm.scatter(flat, dst, root, async_op=a), output_tensors, finish
        )

    # ------------------------------------------------------------------ reduce-scatter

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = _reduce_op(opts.reduceOp, "reduce_scatter")
        out = _single(output_tensors, "reduce_scatter")
        ins = _single(input_tensors, "reduce_scatter")
        _check_cpu("reduce_scatter", out, *ins)
        if len(ins) != self.size():
            raise ValueError(f"oxcomm: reduce_scatter: {len(ins)} input tensors for a group of {self.size()}")
        _same_shape(ins, "reduce_scatter")
        flat = _adjacent_base(ins)
        if flat is None:
            flat = torch.cat([_flat(t.contiguous()) for t in ins])
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        return self._run(
            "reduce_scatter",
            opts,
            lambda a: self.comm.reduce_scatter(flat, dst, op, async_op=a),
            output_tensors,
            finish,
        )

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = _reduce_op(opts.reduceOp, "reduce_scatter_tensor")
        _check_cpu("reduce_scatter_tensor", output, input)
        src = _flat(input.contiguous())
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        return self._run(
            "reduce_scatter_tensor",
            opts,
            lambda a: self.comm.reduce_scatter(src, dst, op, async_op=a),
            [output],
            finish,
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else _done([])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ all-to-all

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(
                f"oxcomm: all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} outputs for a group of {n}"
            )
        _check_cpu("all_to_all", *output_tensors, *input_tensors)
        dtype = input_tensors[0].dtype
        if any(t.dtype != dtype for t in (*input_tensors, *output_tensors)):
            raise NotImplementedError("oxcomm: all_to_all with tensors of different dtypes is not supported")
        send_counts = [t.numel() for t in input_tensors]
        recv_counts = [t.numel() for t in output_tensors]
        send = _adjacent_base(input_tensors) if len(set(send_counts)) == 1 else None
        if send is None:
            send = torch.cat([_flat(t.contiguous()) for t in input_tensors])
        recv = _adjacent_base(output_tensors) if len(set(recv_counts)) == 1 else None
        finish = None
        if recv is None:
            recv = torch.empty(sum(recv_counts), dtype=dtype)

            def finish():
                at = 0
                for o, c in zip(output_tensors, recv_counts):
                    o.copy_(recv[at : at + c].view(o.shape))
                    at += c

        if len(set(send_counts)) == 1 and len(set(recv_counts)) == 1:
            start = lambda a: self.comm.all_to_all(send, recv, async_op=a)  # noqa: E731
        else:
            start = lambda a: self.comm.all_to_all_v(send, send_counts, recv, recv_counts, async_op=a)  # noqa: E731
        return self._run("all_to_all", opts, start, output_tensors, finish)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        _check_cpu("all_to_all_single", output, input)
        src = _flat(input.contiguous())
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        if not output_split_sizes and not input_split_sizes:
            start = lambda a: self.comm.all_to_all(src, dst, async_op=a)  # noqa: E731
        else:
            n = self.size()
            in_row = math.prod(input.shape[1:]) if input.dim() > 1 else 1
            out_row = math.prod(output.shape[1:]) if output.dim() > 1 else 1
            send_counts = (
                [int(s) * in_row for s in input_split_sizes] if input_split_sizes else [input.numel() // n] * n
            )
            recv_counts = (
                [int(s) * out_row for s in output_split_sizes] if output_split_sizes else [output.numel() // n] * n
            )
            if len(send_counts) != n or len(recv_counts) != n:
                raise ValueError(f"oxcomm: all_to_all_single: split sizes must have {n} entries")
            start = lambda a: self.comm.all_to_all_v(src, send_counts, dst, recv_counts, async_op=a)  # noqa: E731
        return self._run("all_to_all_single", opts, start, [output], finish)

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------------ barriers and p2p

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._run("barrier", opts, lambda a: self.comm.barrier(async_op=a), [])

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        timeout = _timeout(opts) if opts is not None and not isinstance(opts, timedelta) else None
        if isinstance(opts, timedelta):
            timeout = opts.total_seconds()
        self._drain()
        self.comm.monitored_barrier(timeout if timeout is not None else 1800.0)

    def _drain(self):
        """Wait until this group's async ops are done (before an op that has no async form)."""
        if not self._waiter.idle():
            fut = torch.futures.Future()
            self._waiter.submit(_Op(_NOTHING, [], None, fut, "drain"))
            fut.wait()

    def send(self, tensors, dst, tag=0):
        t = _single(tensors, "send")
        _check_cpu("send", t)
        buf = t.contiguous()
        return self._p2p("send", lambda: self.comm.isend(buf, dst, tag), tensors, None)

    def recv(self, tensors, src, tag=0):
        t = _single(tensors, "recv")
        _check_cpu("recv", t)
        buf, finish = _contiguous_out(t, None)
        return self._p2p("recv", lambda: self.comm.irecv(buf, src, tag), tensors, finish)

    def _p2p(self, name, start, result, finish):
        fut = torch.futures.Future()
        self._waiter.submit(_Op(start(), result, finish, fut, name))
        return _Work(result, fut)

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError("oxcomm: recv from any source (src=None) is not supported; name the source rank")

    recvAnysource = recv_anysource

    def abort(self):
        try:
            self.comm.abort("torch.distributed abort")
        except Exception:  # noqa: BLE001 - abort is best effort
            pass

    def shutdown(self):
        pass


def communicator(group=None):
    """The :class:`oxcomm.Communicator` behind a torch process group built with backend
    ``"oxcomm"`` (the default group when ``group`` is None); ``None`` on a rank outside the
    group. ``ValueError`` if the group is not an oxcomm group."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(group, ProcessGroupOxcomm):
        return group.comm
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        backend = None
    if isinstance(backend, ProcessGroupOxcomm):
        return backend.comm
    raise ValueError(f"oxcomm: the group's CPU backend is {dist.get_backend(group)!r}, not 'oxcomm'")


def _create(dist_opts, backend_options):
    """The creator torch calls on every member of a new oxcomm group (extended API)."""
    global _world_comm
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    global_ranks = list(dist_opts.global_ranks_in_group)
    comm = None
    if not global_ranks:
        comm = oxcomm.Communicator.from_store(dist_opts.store, rank, size, timeout=seconds)
        _world_comm = comm
        _finalizer_for(comm)
    elif _world_comm is not None and hasattr(_world_comm, "group") and _world_default_is_oxcomm():
        comm = _world_comm.group(global_ranks)
    if comm is None:
        comm = oxcomm.Communicator.from_store(dist_opts.store, rank, size, timeout=seconds)
    if comm.rank != rank or comm.size != size:
        raise RuntimeError(
            f"oxcomm: group of global ranks {global_ranks}: torch says rank {rank} of {size}, "
            f"the communicator says {comm.rank} of {comm.size}"
        )
    return ProcessGroupOxcomm(comm, rank, size)


def _world_default_is_oxcomm():
    try:
        return dist.get_backend() == BACKEND
    except (RuntimeError, ValueError):
        return False


def _finalizer_for(comm):
    def forget(_):
        global _world_comm
        _world_comm = None

    try:
        weakref.finalize(comm, forget, None)
    except TypeError:
        pass


def _register():
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _wrap_env_rendezvous()


def _wrap_env_rendezvous():
    """Make ``init_method="env://"`` (torch's default) work under ``oxcomm launch``.

    That launcher serves oxcomm's own rendezvous store at ``MASTER_ADDR:MASTER_PORT`` (it
    sets ``OXCOMM_STORE=launcher``), which torch's TCPStore cannot speak. On one node the
    ranks then meet on a torch ``FileStore`` named after the job (``OXCOMM_JOB_ID``); a
    multi-node ``oxcomm launch`` of a torch script is refused with a clear error (use
    torchrun). Anywhere else torch's own env:// handler runs unchanged.
    """
    import os
    import tempfile

    import importlib

    # the module (torch.distributed.rendezvous is also the name of a function)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    original = None if handlers is None else handlers.get("env")
    if original is None or getattr(original, "_oxcomm", False):
        return

    def env_handler(url, timeout=timedelta(minutes=30), **kwargs):
        if os.environ.get("OXCOMM_STORE") != "launcher":
            yield from original(url, timeout=timeout, **kwargs)
            return
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local != world:
            raise RuntimeError(
                "oxcomm: torch.distributed under a multi-node `oxcomm launch` is not supported "
                "(its store is oxcomm's, not torch's); launch torch scripts across nodes with torchrun"
            )
        job = os.environ.get("OXCOMM_JOB_ID") or os.environ.get("MASTER_PORT", "0")
        path = os.path.join(tempfile.gettempdir(), f"oxcomm-torch-{job}.store")
        store = dist.FileStore(path, world)
        store.set_timeout(timeout)
        yield (store, rank, world)
        raise RuntimeError("oxcomm: unable to perform re-rendezvous under oxcomm launch")

    env_handler._oxcomm = True
    handlers["env"] = env_handler


_register()


# ---------------------------------------------------------------------------------------- 1-bit Adam


class OnebitAdam(torch.optim.Optimizer):
    """DeepSpeed's 1-bit Adam (``deepspeed/runtime/fp16/onebit/adam.py``) on oxcomm's 1-bit
    all-reduce, for a plain torch loop, a DDP loop or as DeepSpeed's client optimizer.

    Step ``k`` (counting from 1), per parameter, as DeepSpeed does:

    * ``k = 1`` (the initialization step): nothing but the step count changes (DeepSpeed
      only allocates its error buffers).
    * warm-up (not frozen): the gradient is averaged exactly over the group (unless someone
      else already did: see ``grads_averaged``), ``m ← β1·m + (1−β1)·g``,
      ``v ← β2·v + (1−β2)·g²``, ``p ← p − lr·(m/(√v + eps) + wd·p)``. When the step count
      reaches ``freeze_step`` the optimizer freezes.
    * frozen: ``m ← β1·m + (1−β1)·g_local`` with this rank's own gradient, then ``m ←``
      oxcomm's 1-bit error-compensated all-reduce of ``m`` (one per parameter, with
      DeepSpeed's padding and per-rank error buffers), ``v`` frozen, same update.

    As in DeepSpeed there is no bias correction, and a parameter group may carry an
    ``exp_avg_mask`` (a tensor broadcastable to its parameters) that multiplies the momentum
    after each compressed step: 1-bit compression cannot represent an exact zero, so elements
    whose gradient is always zero (unused embedding rows, units that never fire) would otherwise
    get an update of ``scale / eps`` and diverge. Who averages the warm-up gradients:

    * a plain loop: this optimizer (``grads_averaged=False``, the default);
    * DDP: register :meth:`ddp_comm_hook` (``model.register_comm_hook(None, opt.ddp_comm_hook)``):
      it averages buckets while warming up and sends nothing once frozen;
    * DeepSpeed: call :meth:`bind_engine` with the engine ``deepspeed.initialize`` returned;
      the engine averages while warming up and its backward all-reduce is switched off at
      freeze time, as DeepSpeed's own OnebitAdam does.

    ``group`` is an oxcomm torch process group (default: the default group) or an
    :class:`oxcomm.Communicator`.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        freeze_step=100000,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        group=None,
        grads_averaged=False,
        bias_correction=True,
        amsgrad=False,
    ):
        if amsgrad:
            raise RuntimeError("1-bit Adam does not support the AMSGrad variant")
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.comm = group if isinstance(group, oxcomm.Communicator) else communicator(group)
        self.grads_averaged = grads_averaged
        self.frozen = False
        self.steps = 0
        self._engine = None

    @property
    def size(self):
        return self.comm.size

    def bind_engine(self, engine):
        """Use DeepSpeed's protocol: ``engine`` averages gradients while warming up, and its
        backward all-reduce is switched off at freeze time."""
        self._engine = engine
        self.grads_averaged = True
        if self.frozen:
            self._set_engine_allreduce(False)

    def _set_engine_allreduce(self, on):
        if self._engine is None:
            return
        if hasattr(self._engine, "pipeline_enable_backward_allreduce"):
            self._engine.pipeline_enable_backward_allreduce = on
        else:
            self._engine.enable_backward_allreduce = on

    def ddp_comm_hook(self, state, bucket):
        """A DDP communication hook: the exact average while warming up, nothing once frozen
        (each rank keeps its local gradient; the momentum is compressed in :meth:`step`)."""
        t = bucket.buffer()
        fut = torch.futures.Future()
        if self.frozen:
            fut.set_result(t)
            return fut
        self.comm.all_reduce(t, oxcomm.ReduceOp.AVG)
        fut.set_result(t)
        return fut

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("1-bit Adam does not support sparse gradients")
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise TypeError(f"OnebitAdam: parameters must be float32 CPU tensors, got {p.dtype} on {p.device}")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
        if self.steps == 1:
            return loss
        if not self.frozen and not self.grads_averaged and self.comm.size > 1 and params:
            grads = [p.grad for p in params]
            if all(g.is_contiguous() for g in grads):
                self.comm.all_reduce_coalesced(grads, oxcomm.ReduceOp.AVG)
            else:
                for g in grads:
                    g.copy_(self._averaged(g))
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                grad = p.grad
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                if not self.frozen:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    if self.comm.size > 1:
                        self._compressed(state, exp_avg)
                    mask = group.get("exp_avg_mask")
                    if mask is not None:
                        exp_avg.mul_(mask)
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])
        if not self.frozen and self.steps >= self.freeze_step:
            self.frozen = True
            self._set_engine_allreduce(False)
        return loss

    def _averaged(self, g):
        c = g.contiguous()
        self.comm.all_reduce(c, oxcomm.ReduceOp.AVG)
        return c

    def _compressed(self, state, exp_avg):
        """``exp_avg ← compressed_allreduce(exp_avg)`` with this parameter's error state."""
        from oxcomm import onebit

        n = exp_avg.numel()
        if "onebit" not in state:
            state["onebit"] = onebit.State(n, self.comm)
            state["onebit_buf"] = torch.zeros(state["onebit"].padded_len, dtype=torch.float32)
        st, buf = state["onebit"], state["onebit_buf"]
        buf[:n].copy_(exp_avg.view(-1))
        buf[n:].zero_()
        onebit.all_reduce(self.comm, buf, st)
        exp_avg.view(-1).copy_(buf[:n])

    def load_state_dict(self, state_dict):
        """As DeepSpeed: the error buffers are dropped (they are per rank) and the freeze state
        follows the loaded step count."""
        super().load_state_dict(state_dict)
        steps = 0
        for st in self.state.values():
            st.pop("onebit", None)
            st.pop("onebit_buf", None)
            steps = max(steps, int(st.get("step", 0)))
        self.steps = steps
        self.frozen = steps >= self.freeze_step and steps > 1
        self._set_engine_allreduce(not self.frozen)

    def state_dict(self):
        sd = super().state_dict()
        for st in sd["state"].values():
            st.pop("onebit", None)
            st.pop("onebit_buf", None)
        return sd
