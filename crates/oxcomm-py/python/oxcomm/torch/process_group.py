"""The c10d process group behind backend ``"oxcomm"``: torch's calls mapped onto a communicator.

One file over the usual ~600 lines because it is one table: every c10d call beside its
translation (the group class and the c10d ``Backend`` subclass that serves one device of a mixed
spec share it), which reads best in one place.

This module owns the mapping of torch's c10d calls (their option structs, tensor lists and
``Work`` objects) onto an :class:`oxcomm.Communicator`, one communicator per torch process
group. It does not move bytes, check peers' sizes or name errors: the communicator does, and
its exceptions (:class:`oxcomm.OxcommError` and subclasses) reach the caller unchanged.
Completion (``Work``, futures, the waiter thread) is :mod:`oxcomm.torch.work`'s.

What torch can ask for and oxcomm cannot do raises ``NotImplementedError`` naming the call:
``PREMUL_SUM`` on the coalesced calls, sparse all-reduce other than SUM on the host, all-gather/gather/scatter
lists whose tensors differ in shape, and multi-tensor (multi-device) variants of the
single-tensor collectives.

Coalesced calls are one oxcomm op per dtype, not loops: ``allreduce_coalesced`` and
``allgather_coalesced``/``allgather_into_tensor_coalesced`` run the communicator's coalesced
all-reduce and all-gather, ``reduce_scatter_tensor_coalesced`` one reduce-scatter of the inputs
packed rank block by rank block; torch's coalescing region (``_start_coalescing`` /
``_end_coalescing``, which ``batch_isend_irecv`` opens) holds its isend/irecv back until it
ends, so they start as one batch.

Ops run in order per group. ``async_op=False`` calls run on the calling thread (the GIL is
released by oxcomm while they wait); ``async_op=True`` calls return at once and fill the
caller's tensors in place when they complete. ``Work.get_future()`` (which DDP uses) is
completed by one waiter thread per group.

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

import math
import re
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import oxcomm
from oxcomm import _native
from oxcomm._buffers import DTYPE_CODES as _DTYPE_CODES
from oxcomm._buffers import TORCH_CLASSES as _HOST_CLASSES
from oxcomm._cuda import device as _dev
from oxcomm._cuda import staging as _staging

from .work import _DONE, _NOTHING, _done, _Op, _Waiter, _Work

_c10d = torch._C._distributed_c10d
_C10dBackend = _c10d.Backend

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

_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM
_STRIDED = torch.strided


def _fast_ops():
    """{hash of a torch ReduceOp: index of oxcomm's op in ``_native.REDUCE_OPS``} for the plain
    ops: torch hashes a ReduceOp by its kind (one int per RedOpType), so the blocking
    all_reduce reads the op with one getter and one hash instead of comparisons through
    pybind. Built from torch's own objects; empty (every op takes the general path) if this
    torch hashes two kinds alike or PREMUL_SUM like a plain one."""
    try:
        kinds = {name: hash(dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, name))) for name in _OPS}
        premul = hash(dist._make_nccl_premul_sum(1.0))
    except Exception:  # noqa: BLE001 - a torch without these: no fast ops
        return {}
    if len(set(kinds.values())) != len(kinds) or premul in kinds.values():
        return {}
    return {h: _native.REDUCE_OPS.index(_OPS[name].lower()) for name, h in kinds.items()}


_FAST_OPS = _fast_ops()


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


def _premul_factor(op):
    """The factor of a ``PREMUL_SUM`` op (``dist._make_nccl_premul_sum(factor)``: a number or a
    one-element tensor), or None for any other op.

    NCCL's premul-sum is ``sum_i(factor_i * x_i)``: the calls that take it scale their input by
    the factor (in place where the input is overwritten by the result anyway, else a scaled
    copy) and sum."""
    if getattr(op, "op", op) != _PREMUL_SUM:
        return None
    factor = getattr(op, "factor", None)
    if factor is None:
        raise NotImplementedError("oxcomm: ReduceOp.PREMUL_SUM whose factor this torch does not expose")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"oxcomm: PREMUL_SUM takes a one-element factor tensor, got {factor.numel()} elements")
        return factor.reshape(())
    return factor


def _scaled(t, factor, in_place):
    """``t`` times a premul factor: ``t`` itself scaled when ``in_place``, else a new tensor."""
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t.device)
    return t.mul_(factor) if in_place else t * factor


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


def _on_device(call, *tensors):
    """Whether the call's tensors are device (CUDA) tensors; ``ValueError`` naming the call when
    some are and some are not."""
    owned = [_dev.owns(t) for t in tensors if t is not None]
    if not any(owned):
        return False
    if not all(owned):
        where = sorted({str(t.device) for t in tensors if t is not None})
        raise ValueError(f"oxcomm: {call}: tensors on {', '.join(where)} in one call; pass all of them on one device")
    return True


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
    return first.new_empty((0,)).set_(storage, first.storage_offset(), (n * len(tensors),))


def _by_dtype(tensors):
    """Indices of ``tensors`` grouped by dtype, in order of first appearance (one native
    coalesced op moves one dtype)."""
    groups = {}
    for k, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(k)
    return list(groups.values())


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


def _late_ranks(message):
    """The ranks a monitored barrier's timeout names ("rank(s) 1, 3 did not join"), or []."""
    found = re.search(r"rank\(s\) ([0-9, ]+) did not join", message)
    return [int(r) for r in found.group(1).replace(" ", "").split(",") if r] if found else []


def _same_shape(tensors, call):
    shape = tensors[0].shape
    if any(t.shape != shape or t.dtype != tensors[0].dtype for t in tensors):
        raise NotImplementedError(f"oxcomm: {call} with tensors of different shapes or dtypes is not supported")


class _Calls:
    """torch's c10d calls on an oxcomm communicator; the two classes below add what a
    ``ProcessGroup`` and a ``Backend`` each need around them.

    ``self.comm`` is the group's :class:`oxcomm.Communicator` (rank and size as torch's).
    """

    def _setup(self, comm):
        self.comm = comm
        self._native = comm._c
        self._waiter = _Waiter()
        # The coalescing region torch opened (``_start_coalescing``): None outside one, else
        # (every op issued in it, the point-to-point ops not yet handed to the waiter).
        self._region = None

    @property
    def supports_splitting(self):
        return False

    @property
    def supports_coalescing(self):
        # torch opens coalescing regions on the group itself (a ProcessGroup subclass); the
        # c10d Backend subclass of a mixed spec is reached through torch's C++ group instead.
        return isinstance(self, dist.ProcessGroup)

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
            fut = torch.futures.Future()
            self._submit(_Op(native, result, None, fut, op))
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

    # ------------------------------------------------------------------ reductions

    def allreduce(self, tensors, opts=None):
        # The blocking one-tensor call a training step makes most: straight to the native
        # communicator, each check made once and inline (each 0.1 µs here is 0.1 µs of every
        # small all-reduce; docs/perf_torch_path.md). The tensor passes only if it is of a
        # class and dtype that _buffers.buffer() accepted before, on the host, strided and
        # contiguous; the op only if torch's ReduceOp hashes to a plain one (not PREMUL_SUM).
        # Anything else takes the general path below, whose checks name the problem.
        if opts is not None and len(tensors) == 1 and not opts.asyncOp and self._waiter.idle():
            t = tensors[0]
            if t.__class__ in _HOST_CLASSES and not _dev.OVERRIDDEN:
                dtype = _DTYPE_CODES.get(t.dtype)
                if dtype is not None and t.is_cpu and t.layout is _STRIDED and t.is_contiguous():
                    op = _FAST_OPS.get(hash(opts.reduceOp))
                    if op is not None:
                        self._native.all_reduce_at(t.data_ptr(), t.numel(), dtype, op)
                        return _DONE
        opts = opts or dist.AllreduceOptions()
        if len(tensors) == 1 and tensors[0].layout == torch.sparse_coo:
            return self.allreduce_sparse(tensors, opts)
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "all_reduce")
        dev = _on_device("all_reduce", *tensors)
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        if factor is not None:
            _scaled(tensors[0], factor, True)
        buf, finish = _contiguous_out(tensors[0], None)
        start = lambda a: self.comm.all_reduce(buf, op, async_op=a)  # noqa: E731
        return self._run("all_reduce", opts, start, tensors, finish, device=dev)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "all_reduce_coalesced")
        dev = _on_device("all_reduce_coalesced", *tensors)
        for t in tensors if factor is not None else ():
            _scaled(t, factor, True)
        finish = None
        bufs = []
        for t in tensors:
            b, finish = _contiguous_out(t, finish)
            bufs.append(b)
        groups = _by_dtype(bufs)

        def start(a):
            works = [self.comm.all_reduce_coalesced([bufs[k] for k in idx], op, async_op=a) for idx in groups]
            return _last(works, a)

        return self._run("all_reduce_coalesced", opts, start, tensors, finish, device=dev)

    def allreduce_sparse(self, tensors, opts=None):
        """All-reduce (SUM) of a sparse COO tensor on the host, as gloo's: every rank's
        coalesced indices and values are all-gathered (padded to the largest count) and summed
        into one coalesced tensor, which replaces the input's contents. Runs blocking, after
        the group's ops in flight; O(total nonzeros) bytes per rank."""
        opts = opts or dist.AllreduceOptions()
        t = _single(tensors, "all_reduce (sparse)")
        if t.layout != torch.sparse_coo:
            raise ValueError(f"oxcomm: all_reduce (sparse): a {t.layout} tensor is not sparse COO")
        if not t.is_cpu:
            raise NotImplementedError("oxcomm: all_reduce of sparse tensors on a device is not supported")
        if _premul_factor(opts.reduceOp) is not None or _reduce_op(opts.reduceOp, "all_reduce") != oxcomm.ReduceOp.SUM:
            raise NotImplementedError("oxcomm: all_reduce of sparse tensors supports SUM only (as gloo)")
        self._drain()
        c = t.coalesce()
        idx, val = c.indices().contiguous(), c.values().contiguous()
        n, nnz = self.comm.size, idx.shape[1]
        counts = torch.zeros(n, dtype=torch.int64)
        self.comm.all_gather(torch.tensor([nnz], dtype=torch.int64), counts)
        top = int(counts.max())
        pad_idx = torch.zeros((idx.shape[0], top), dtype=torch.int64)
        pad_idx[:, :nnz] = idx
        pad_val = torch.zeros((top, *val.shape[1:]), dtype=val.dtype)
        pad_val[:nnz] = val
        all_idx = torch.empty((n, *pad_idx.shape), dtype=torch.int64)
        all_val = torch.empty((n, *pad_val.shape), dtype=val.dtype)
        self.comm.all_gather(pad_idx.reshape(-1), all_idx.reshape(-1))
        self.comm.all_gather(pad_val.reshape(-1), all_val.reshape(-1))
        keep = [int(k) for k in counts]
        indices = torch.cat([all_idx[r][:, : keep[r]] for r in range(n)], dim=1)
        values = torch.cat([all_val[r][: keep[r]] for r in range(n)], dim=0)
        total = torch.sparse_coo_tensor(indices, values, t.shape, dtype=t.dtype).coalesce()
        t.copy_(total)
        return _done([t])

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "reduce")
        t = _single(tensors, "reduce")
        dev = _on_device("reduce", t)
        root = opts.rootRank
        if factor is not None and self.rank() != root:
            # Other ranks' tensors stay as they were: they send a scaled copy.
            buf, finish = _scaled(t, factor, False).contiguous(), None
        else:
            if factor is not None:
                _scaled(t, factor, True)
            buf, finish = _contiguous_out(t, None)
        start = lambda a: self.comm.reduce(buf, root, op, async_op=a)  # noqa: E731
        return self._run("reduce", opts, start, tensors, finish, device=dev)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        t = _single(tensors, "broadcast")
        dev = _on_device("broadcast", t)
        buf, finish = _contiguous_out(t, None)
        root = opts.rootRank
        start = lambda a: self.comm.broadcast(buf, root, async_op=a)  # noqa: E731
        return self._run("broadcast", opts, start, tensors, finish, device=dev)

    # ------------------------------------------------------------------ gathers

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or _c10d.AllgatherOptions()
        inp = _single(input_tensors, "all_gather").contiguous()
        outs = _single(output_tensors, "all_gather")
        dev = _on_device("all_gather", inp, *outs)
        if len(outs) != self.size():
            raise ValueError(f"oxcomm: all_gather: {len(outs)} output tensors for a group of {self.size()}")
        _same_shape(outs, "all_gather")
        flat = _adjacent_base(outs)
        finish = None
        if flat is None:
            flat = inp.new_empty((inp.numel() * len(outs),))

            def finish():
                for k, o in enumerate(outs):
                    o.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view(o.shape))

        src = _flat(inp)
        start = lambda a: self.comm.all_gather(src, flat, async_op=a)  # noqa: E731
        return self._run("all_gather", opts, start, output_tensors, finish, device=dev)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or _c10d.AllgatherOptions()
        dev = _on_device("all_gather_into_tensor", output, input)
        src = _flat(input.contiguous())
        out, finish = _contiguous_out(output, None)
        dst = _flat(out)
        start = lambda a: self.comm.all_gather(src, dst, async_op=a)  # noqa: E731
        return self._run("all_gather_into_tensor", opts, start, [output], finish, device=dev)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """``all_gather_into_tensor`` of each input into the matching output, as one
        ``all_gather_coalesced`` per dtype."""
        opts = opts or _c10d.AllgatherOptions()
        call = "all_gather_into_tensor_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(f"oxcomm: {call}: {len(outputs)} outputs for {len(inputs)} inputs")
        dev = _on_device(call, *outputs, *inputs)
        ins, outs, finish = [], [], None
        for o, i in zip(outputs, inputs):
            if o.numel() != i.numel() * self.size():
                raise ValueError(
                    f"oxcomm: {call}: an output of {o.numel()} elements for an input of {i.numel()} "
                    f"in a group of {self.size()}"
                )
            buf, finish = _contiguous_out(o, finish)
            ins.append(_flat(i.contiguous()))
            outs.append(_flat(buf))
        return self._gather_coalesced(call, opts, ins, outs, list(outputs), finish, dev)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``all_gather_coalesced``: ``output_lists[r][j]`` gets rank r's ``inputs[j]``; one
        ``all_gather_coalesced`` per dtype, into each tensor's outputs in place when they lie
        back to back in one storage, else into scratch copied out."""
        opts = opts or _c10d.AllgatherOptions()
        call = "all_gather_coalesced"
        n = self.size()
        if len(output_lists) != n or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(
                f"oxcomm: {call}: outputs must be {n} lists (one per rank) of {len(inputs)} tensors, got "
                f"{[len(o) for o in output_lists]}"
            )
        dev = _on_device(call, *inputs, *(t for o in output_lists for t in o))
        ins, outs, copies = [], [], []
        for j, i in enumerate(inputs):
            per_rank = [output_lists[r][j] for r in range(n)]
            if any(t.numel() != i.numel() or t.dtype != i.dtype for t in per_rank):
                raise NotImplementedError(f"oxcomm: {call}: outputs[r][{j}] differ from inputs[{j}] in size or dtype")
            flat = _adjacent_base(per_rank)
            if flat is None:
                flat = i.new_empty((i.numel() * n,))
                copies.append((flat, per_rank))
            ins.append(_flat(i.contiguous()))
            outs.append(flat)
        finish = None
        if copies:

            def finish():
                for flat, per_rank in copies:
                    for k, o in enumerate(flat.chunk(n) if flat.numel() else [flat] * n):
                        per_rank[k].copy_(o.view(per_rank[k].shape))

        return self._gather_coalesced(call, opts, ins, outs, list(output_lists), finish, dev)

    def _gather_coalesced(self, call, opts, ins, outs, result, finish, dev):
        """One native ``all_gather_coalesced`` per dtype among ``ins`` (flat inputs) into
        ``outs`` (flat outputs, size × input each)."""
        groups = _by_dtype(ins)

        def start(a):
            works = [
                self.comm.all_gather_coalesced([ins[k] for k in idx], [outs[k] for k in idx], async_op=a)
                for idx in groups
            ]
            return _last(works, a)

        return self._run(call, opts, start, result, finish, device=dev)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        inp = _single(input_tensors, "gather").contiguous()
        root = opts.rootRank
        finish = None
        flat = None
        dev = _on_device("gather", inp)
        if self.rank() == root:
            outs = _single(output_tensors, "gather")
            dev = _on_device("gather", inp, *outs)
            if len(outs) != self.size():
                raise ValueError(f"oxcomm: gather: {len(outs)} output tensors for a group of {self.size()}")
            _same_shape(outs, "gather")
            flat = _adjacent_base(outs)
            if flat is None:
                flat = inp.new_empty((inp.numel() * len(outs),))

                def finish():
                    for k, o in enumerate(outs):
                        o.copy_(flat[k * inp.numel() : (k + 1) * inp.numel()].view(o.shape))

        src = _flat(inp)
        return self._run(
            "gather", opts, lambda a: self.comm.gather(src, flat, root, async_op=a), output_tensors, finish, device=dev
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        out = _single(output_tensors, "scatter")
        root = opts.rootRank
        flat = None
        dev = _on_device("scatter", out)
        if self.rank() == root:
            ins = _single(input_tensors, "scatter")
            dev = _on_device("scatter", out, *ins)
            if len(ins) != self.size():
                raise ValueError(f"oxcomm: scatter: {len(ins)} input tensors for a group of {self.size()}")
            _same_shape(ins, "scatter")
            flat = _adjacent_base(ins)
            if flat is None:
                flat = torch.cat([_flat(t.contiguous()) for t in ins])
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        start = lambda a: self.comm.scatter(flat, dst, root, async_op=a)  # noqa: E731
        return self._run("scatter", opts, start, output_tensors, finish, device=dev)

    # ------------------------------------------------------------------ reduce-scatter

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "reduce_scatter")
        out = _single(output_tensors, "reduce_scatter")
        ins = _single(input_tensors, "reduce_scatter")
        dev = _on_device("reduce_scatter", out, *ins)
        if len(ins) != self.size():
            raise ValueError(f"oxcomm: reduce_scatter: {len(ins)} input tensors for a group of {self.size()}")
        _same_shape(ins, "reduce_scatter")
        flat = _adjacent_base(ins)
        if flat is None:
            flat = torch.cat([_flat(t.contiguous()) for t in ins])
        if factor is not None:
            flat = _scaled(flat, factor, False)
        buf, finish = _contiguous_out(out, None)
        dst = _flat(buf)
        return self._run(
            "reduce_scatter",
            opts,
            lambda a: self.comm.reduce_scatter(flat, dst, op, async_op=a),
            output_tensors,
            finish,
            device=dev,
        )

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        factor = _premul_factor(opts.reduceOp)
        op = oxcomm.ReduceOp.SUM if factor is not None else _reduce_op(opts.reduceOp, "reduce_scatter_tensor")
        dev = _on_device("reduce_scatter_tensor", output, input)
        src = _flat(input.contiguous())
        if factor is not None:
            src = _scaled(src, factor, False)
        buf, finish = _contiguous_out(output, None)
        dst = _flat(buf)
        return self._run(
            "reduce_scatter_tensor",
            opts,
            lambda a: self.comm.reduce_scatter(src, dst, op, async_op=a),
            [output],
            finish,
            device=dev,
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """``reduce_scatter_tensor`` of each input into the matching output, as one native
        reduce-scatter per dtype: the inputs are packed rank block by rank block (block r of
        the packed buffer is block r of every input, back to back), so rank r's block of the
        reduction holds its block of every input's reduction, copied out into the outputs.
        (oxcomm has no coalesced reduce-scatter with a reduce op for Python yet; the pack costs
        one copy of the inputs and of the outputs.)"""
        opts = opts or dist.ReduceScatterOptions()
        call = "reduce_scatter_tensor_coalesced"
        op = _reduce_op(opts.reduceOp, call)
        n = self.size()
        if len(outputs) != len(inputs):
            raise ValueError(f"oxcomm: {call}: {len(outputs)} outputs for {len(inputs)} inputs")
        dev = _on_device(call, *outputs, *inputs)
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * n:
                raise ValueError(
                    f"oxcomm: {call}: an input of {i.numel()} elements for an output of {o.numel()} "
                    f"in a group of {n}"
                )
        packs = []
        for idx in _by_dtype(inputs):
            src = torch.cat([inputs[k].contiguous().view(n, -1) for k in idx], dim=1).view(-1)
            packs.append((idx, src, src.new_empty((src.numel() // n,))))

        def start(a):
            works = [self.comm.reduce_scatter(src, dst, op, async_op=a) for _, src, dst in packs]
            return _last(works, a)

        def finish():
            for idx, _, dst in packs:
                at = 0
                for k in idx:
                    m = outputs[k].numel()
                    outputs[k].copy_(dst[at : at + m].view(outputs[k].shape))
                    at += m

        return self._run(call, opts, start, list(outputs), finish, device=dev)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------------ all-to-all

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllToAllOptions()
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(
                f"oxcomm: all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} outputs for a group of {n}"
            )
        dev = _on_device("all_to_all", *output_tensors, *input_tensors)
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
            recv = output_tensors[0].new_empty((sum(recv_counts),))

            def finish():
                at = 0
                for o, c in zip(output_tensors, recv_counts):
                    o.copy_(recv[at : at + c].view(o.shape))
                    at += c

        if len(set(send_counts)) == 1 and len(set(recv_counts)) == 1:
            start = lambda a: self.comm.all_to_all(send, recv, async_op=a)  # noqa: E731
        else:
            start = lambda a: self.comm.all_to_all_v(send, send_counts, recv, recv_counts, async_op=a)  # noqa: E731
        return self._run("all_to_all", opts, start, output_tensors, finish, device=dev)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        dev = _on_device("all_to_all_single", output, input)
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
        return self._run("all_to_all_single", opts, start, [output], finish, device=dev)

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
        seconds = timeout if timeout is not None else 1800.0
        if seconds <= 0:
            # gloo's words (torch's tests and users match them), oxcomm's error type
            raise oxcomm.TimeoutError(
                f"Rank {self.rank()} timed out in monitoredBarrier after 0 ms (oxcomm: the timeout was 0)"
            )
        try:
            self.comm.monitored_barrier(seconds)
        except oxcomm.TimeoutError as e:
            late = _late_ranks(str(e))
            if not late:
                raise
            who = f"Ranks {', '.join(map(str, late))}" if wait_all_ranks and len(late) > 1 else f"Rank {late[0]}"
            raise type(e)(f"{who} failed to pass monitoredBarrier in {seconds * 1000:.0f} ms ({e})") from e

    def _drain(self):
        """Wait until this group's async ops are done (before an op that has no async form)."""
        if not self._waiter.idle():
            fut = torch.futures.Future()
            self._waiter.submit(_Op(_NOTHING, [], None, fut, "drain"))
            fut.wait()

    def send(self, tensors, dst, tag=0):
        t = _single(tensors, "send")
        dev = _on_device("send", t)
        buf = t.contiguous()
        return self._p2p("send", lambda: self.comm.isend(buf, dst, tag), tensors, None, dev)

    def recv(self, tensors, src, tag=0):
        t = _single(tensors, "recv")
        dev = _on_device("recv", t)
        buf, finish = _contiguous_out(t, None)
        return self._p2p("recv", lambda: self.comm.irecv(buf, src, tag), tensors, finish, dev)

    def _p2p(self, name, start, result, finish, device, any_source=False):
        if device:
            # the copy out of a scratch tensor goes on the device behind the op's own copies
            with _staging.then(finish):
                native = start()
            finish = None
        else:
            native = start()
        fut = torch.futures.Future()
        self._submit(_Op(native, result, finish, fut, name), batch=True)
        return _Work(result, fut, native if device else None, native.source_rank if any_source else None)

    def recv_anysource(self, tensors, tag=0):
        """``recv``/``irecv`` without ``src``: the first message with ``tag`` from any rank
        of the group; the Work's ``_source_rank()`` names its sender (torch's ``recv``
        returns it)."""
        t = _single(tensors, "recv")
        dev = _on_device("recv", t)
        buf, finish = _contiguous_out(t, None)
        return self._p2p("recv", lambda: self.comm.irecv(buf, None, tag), tensors, finish, dev, any_source=True)

    # ------------------------------------------------------------------ coalescing

    def _submit(self, op, batch=False):
        """Hand ``op`` to the waiter, or, in a coalescing region, keep a point-to-point op
        (``batch``) back until the region ends: the waiter's first wait starts the pending
        isend/irecv as one native batch, so they must all be issued before it."""
        region = self._region
        if region is None:
            self._waiter.submit(op)
            return
        ops, held = region
        ops.append(op)
        if batch:
            held.append(op)
            return
        self._release(held)
        self._waiter.submit(op)

    def _release(self, held):
        for op in held:
            self._waiter.submit(op)
        held.clear()

    def _start_coalescing(self, device=None):
        """torch's ``_coalescing_manager`` (and ``batch_isend_irecv``) opens a region: the
        isend/irecv issued in it run as one oxcomm batch; its all_reduce,
        all_gather_into_tensor and reduce_scatter_tensor calls reach this group as one
        ``*_coalesced`` call (torch gathers them)."""
        if self._region is not None:
            raise RuntimeError("oxcomm: _start_coalescing: a coalescing region is already open on this group")
        self._region = ([], [])

    def _end_coalescing(self, device=None):
        """Close the region: its held point-to-point ops start (one batch) and the Work
        returned completes when every op of the region has (torch keeps only this Work)."""
        region, self._region = self._region, None
        if region is None:
            raise RuntimeError("oxcomm: _end_coalescing without _start_coalescing")
        ops, held = region
        self._release(held)
        if not ops:
            return _done([])
        fut = torch.futures.Future()
        self._waiter.submit(_Op(_AllOf([o.future for o in ops]), [], None, fut, "coalesced"))
        return _Work([], fut)

    recvAnysource = recv_anysource

    def abort(self):
        try:
            self.comm.abort("torch.distributed abort")
        except Exception:  # noqa: BLE001 - abort is best effort
            pass

    def shutdown(self):
        pass


class ProcessGroupOxcomm(_Calls, dist.ProcessGroup):
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



class BackendOxcomm(_Calls, _C10dBackend):
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
