"""oxcomm: collective communication for Python — all-reduce, all-gather,
reduce-scatter, broadcast, all-to-all, point-to-point, groups, async ops, DeepSpeed's 1-bit
all-reduce and ZeRO++'s quantized reduce-scatter — over shared memory between processes of
one host and TCP between hosts. The engine is the Rust crate ``oxcomm``.

Buffers are numpy arrays and torch CPU tensors, read and written in place (no copy), and torch
CUDA tensors, staged through pinned host memory with NCCL's stream semantics (the op runs after
the work queued on the tensor's current stream, and later work on that stream sees the result;
see :mod:`oxcomm._cuda`). Every op releases the GIL while it runs; ``async_op=True`` returns a
:class:`Work` at once and fills the buffers in place when the op completes.

    import numpy as np, oxcomm
    comm = oxcomm.init()                # under `oxcomm launch -n 4 -- python3 prog.py`
    x = np.full(1024, comm.rank, dtype=np.float32)
    comm.all_reduce(x)                  # sum over ranks, in place

``import oxcomm.torch`` registers the torch.distributed backend ``"oxcomm"``;
``oxcomm.deepspeed`` has DeepSpeed's 1-bit ``CompressedBackend`` and ZeRO++ helpers.
"""

import collections as _collections
import enum as _enum
import os as _os
import pickle as _pickle

from . import _native
from ._cuda import device as _dev
from ._cuda import ops as _staged
from ._buffers import block_of as _block_of
from ._buffers import buffer as _buf
from ._buffers import copy_of as _copy_of
from ._buffers import overlap as _overlap
from ._buffers import same as _same
from ._errors import (  # noqa: F401 - re-exported
    AbortedError,
    InvalidArgumentError,
    IoError,
    MismatchError,
    OxcommError,
    PeerGoneError,
    ProtocolError,
    RendezvousError,
    RevokedError,
    SuspectedError,
    TimeoutError,
    UnsupportedError,
)

Work = _native.Work


class Agreed(_collections.namedtuple("Agreed", ["flag", "failed"])):
    """What :meth:`Communicator.agree` returns, the same on every survivor: ``flag``, the
    bitwise AND of the survivors' flags, and ``failed``, the ranks that took no part."""

    __slots__ = ()


class ReduceOp(_enum.Enum):
    """How an all-reduce, reduce or reduce-scatter combines values."""

    SUM = "sum"
    AVG = "avg"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


def _op(op):
    if isinstance(op, ReduceOp):
        return op.value
    if isinstance(op, str):
        return op
    raise TypeError(f"op: expected an oxcomm.ReduceOp or its name, got {op!r}")


def _input(inp, out, name, b=None):
    """``inp``'s buffer (``b`` if already made); a copy of it when it shares memory with ``out``
    (Rust may not alias them)."""
    if b is None:
        b = _buf(inp, name, write=False)
    if _overlap(b, out):
        b = _buf(_copy_of(inp), name, write=False)
    return b


def _store_options(timeout, transport, master_addr, pin_to_core):
    """The keyword arguments of ``_native.Communicator.from_store`` / ``join_from_store``, with
    the environment's defaults (``MASTER_ADDR``, ``OXCOMM_BIND=core``)."""
    if master_addr is None:
        master_addr = _os.environ.get("MASTER_ADDR") or None
    if pin_to_core is None:
        pin_to_core = _os.environ.get("OXCOMM_BIND", "").strip() == "core"
    return {
        "timeout": float(timeout),
        "transport": transport,
        "master_addr": master_addr,
        "pin_to_core": bool(pin_to_core),
    }


class Communicator:
    """One rank's handle on a group of ranks; see the module docs."""

    # _st: the staging state (oxcomm._cuda.staging.Stager), made by the first op on device
    # tensors; from then on every op goes through it, so that ops queued behind an async device
    # op keep their issue order. A host twin of this communicator (``_st`` None) runs the ops
    # on staged host buffers.
    __slots__ = ("_c", "_st", "__weakref__")

    def __init__(self, native):
        self._c = native
        self._st = None

    def _stager(self):
        if self._st is None:
            from ._cuda.staging import Stager

            self._st = Stager(Communicator(self._c), f"rank{self._c.rank}")
        return self._st

    def _drain(self, what):
        """Before an op with no staged form: wait until the ops queued before it are issued."""
        if self._st is not None:
            self._st.drain(what)

    @staticmethod
    def from_store(store, rank, world_size, *, timeout=300.0, transport=None, master_addr=None, pin_to_core=None):
        """Joins a job through a key-value store with torch.distributed.Store's methods.

        Rank 0 makes the job's secret and id and publishes them in the store, so the store
        must be private to the job (torch's stores are). ``transport``: ``"auto"`` (shared
        memory on a host, TCP across), ``"shm"`` or ``"tcp"``. ``master_addr``: an address of
        the store's host, used to pick the interface for TCP links (default loopback).
        ``pin_to_core``: pin the calling thread to its own core when every local rank has one
        (default: only if ``OXCOMM_BIND=core``; threads started later inherit the mask).
        """
        kw = _store_options(timeout, transport, master_addr, pin_to_core)
        return Communicator(_native.Communicator.from_store(store, rank, world_size, **kw))

    @staticmethod
    def join_from_store(store, *, timeout=300.0, transport=None, master_addr=None, pin_to_core=None):
        """Joins a running job as a newcomer (a replacement for a rank that failed), through
        the store its ranks met at with :meth:`from_store` (the same store object or an
        equal one: same server, same prefix).

        Reads the job's secret and id there, waits for the members to call :meth:`grow`
        (at most ``timeout`` seconds in all, then :class:`TimeoutError`), takes the first
        free rank after theirs and returns the grown communicator: its ``rank`` and ``size``
        say where this process stands, and its ops' deadline is ``timeout``. What the
        newcomer must know to go on (the step, the weights) the application sends it on that
        communicator, e.g. a broadcast from rank 0. The other arguments are
        :meth:`from_store`'s.
        """
        kw = _store_options(timeout, transport, master_addr, pin_to_core)
        return Communicator(_native.Communicator.join_from_store(store, **kw))

    rank = property(lambda self: self._c.rank, doc="This rank within the group.")
    size = property(lambda self: self._c.size, doc="Number of ranks in the group.")
    world_rank = property(lambda self: self._c.world_rank, doc="This rank in the world.")
    world_size = property(lambda self: self._c.world_size, doc="Number of ranks in the world.")
    transport = property(lambda self: self._c.transport, doc="threads, shm, tcp, shm+tcp or mpi.")
    members = property(lambda self: self._c.members, doc="World rank of every group rank.")

    def __repr__(self):
        return repr(self._c)

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, buf, op=ReduceOp.SUM, *, async_op=False):
        """Reduces ``buf`` over the group in place."""
        if self._st is not None or _dev.owns(buf):
            return _staged.all_reduce(self._stager(), buf, op, async_op)
        return self._c.all_reduce(_buf(buf, "buf"), _op(op), async_op)

    def all_reduce_premul_sum(self, buf, factor, *, async_op=False):
        """Sums every rank's ``factor * buf`` over the group into ``buf`` (torch's and NCCL's
        ``PREMUL_SUM``; ranks may pass different factors)."""
        if self._st is not None or _dev.owns(buf) or isinstance(factor, complex):
            buf *= factor  # on the device, or a complex factor: scaled by the array library
            return self.all_reduce(buf, ReduceOp.SUM, async_op=async_op)
        return self._c.all_reduce_premul_sum(_buf(buf, "buf"), float(factor), async_op)

    def all_reduce_into(self, input, output, op=ReduceOp.SUM, *, async_op=False):  # noqa: A002
        """Out-of-place all-reduce: ``output`` gets the reduction of every rank's ``input``."""
        if self._st is not None or _dev.owns(input) or _dev.owns(output):
            if input is output:
                return _staged.all_reduce(self._stager(), output, op, async_op)
            return _staged.all_reduce_into(self._stager(), input, output, op, async_op)
        if input is output:
            return self.all_reduce(output, op, async_op=async_op)
        out = _buf(output, "output")
        return self._c.all_reduce_into(_input(input, out, "input"), out, _op(op), async_op)

    def reduce(self, buf, root, op=ReduceOp.SUM, *, async_op=False):
        """Reduces ``buf`` into the root's ``buf``; other ranks' buffers are left unchanged."""
        if self._st is not None or _dev.owns(buf):
            return _staged.reduce(self._stager(), buf, root, op, async_op)
        return self._c.reduce(_buf(buf, "buf"), root, _op(op), async_op)

    def reduce_into(self, input, output, root, op=ReduceOp.SUM, *, async_op=False):  # noqa: A002
        """Out-of-place reduce (MPI_Reduce): the root's ``output`` gets the reduction of every
        rank's ``input`` (``output`` is ``None`` elsewhere); no rank's ``input`` is written."""
        if self._st is not None or _dev.owns(input) or _dev.owns(output):
            if input is output:
                return _staged.reduce(self._stager(), output, root, op, async_op)
            return _staged.reduce_into(self._stager(), input, output, root, op, async_op)
        if input is output:
            return self.reduce(output, root, op, async_op=async_op)
        out = None if output is None else _buf(output, "output")
        inp = _buf(input, "input", write=False) if out is None else _input(input, out, "input")
        return self._c.reduce_into(inp, out, root, _op(op), async_op)

    def broadcast(self, buf, root, *, async_op=False):
        """The root's ``buf`` on every rank."""
        if self._st is not None or _dev.owns(buf):
            return _staged.broadcast(self._stager(), buf, root, async_op)
        return self._c.broadcast(_buf(buf, "buf"), root, async_op)

    def all_gather(self, input, output, *, async_op=False):  # noqa: A002
        """``output`` (size × len(input)) gets every rank's ``input`` in rank order.

        An ``input`` that is this rank's block of ``output`` (a view, as FSDP passes it) runs
        in place, without copying it first."""
        if self._st is not None or _dev.owns(input) or _dev.owns(output):
            return _staged.all_gather(self._stager(), input, output, async_op)
        out = _buf(output, "output")
        inp = _buf(input, "input", write=False)
        if _block_of(inp, out, self.rank, self.size):
            return self._c.all_gather_in_place(out, async_op)
        return self._c.all_gather(_input(input, out, "input", inp), out, async_op)

    def all_gather_in_place(self, buf, *, async_op=False):
        """All-gather in place: ``buf`` holds one block per rank, this rank's holding its input."""
        if self._st is not None or _dev.owns(buf):
            return _staged.all_gather_in_place(self._stager(), buf, async_op)
        return self._c.all_gather_in_place(_buf(buf, "buf"), async_op)

    def reduce_scatter(self, input, output, op=ReduceOp.SUM, *, async_op=False):  # noqa: A002
        """``output`` gets this rank's block of the reduction of ``input`` (size × len(output))."""
        if self._st is not None or _dev.owns(input) or _dev.owns(output):
            return _staged.reduce_scatter(self._stager(), input, output, op, async_op)
        out = _buf(output, "output")
        return self._c.reduce_scatter(_input(input, out, "input"), out, _op(op), async_op)

    def reduce_scatter_in_place(self, buf, op=ReduceOp.SUM, *, async_op=False):
        """Reduce-scatter in place: this rank's block of ``buf`` gets its block of the reduction;
        the other blocks hold garbage afterwards (some algorithms use them)."""
        if self._st is not None or _dev.owns(buf):
            return _staged.reduce_scatter_in_place(self._stager(), buf, op, async_op)
        return self._c.reduce_scatter_in_place(_buf(buf, "buf"), _op(op), async_op)

    def all_to_all(self, send, recv, *, async_op=False):
        """Block j of ``send`` goes to rank j; block i of ``recv`` comes from rank i (``send``
        may be ``recv`` itself: then it runs in place, without a copy)."""
        if self._st is not None or _dev.owns(send) or _dev.owns(recv):
            return _staged.all_to_all(self._stager(), send, recv, async_op)
        out = _buf(recv, "recv")
        inp = _buf(send, "send", write=False)
        if _same(inp, out):
            return self._c.all_to_all_in_place(out, async_op)
        return self._c.all_to_all(_input(send, out, "send", inp), out, async_op)

    def all_to_all_in_place(self, buf, *, async_op=False):
        """All-to-all in place: block j of ``buf`` goes to rank j, block i comes from rank i."""
        if self._st is not None or _dev.owns(buf):
            return _staged.all_to_all_in_place(self._stager(), buf, async_op)
        return self._c.all_to_all_in_place(_buf(buf, "buf"), async_op)

    def all_to_all_v(self, send, send_counts, recv, recv_counts, *, async_op=False):
        """Uneven all-to-all; counts in elements per rank."""
        if self._st is not None or _dev.owns(send) or _dev.owns(recv):
            counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
            return _staged.all_to_all_v(self._stager(), send, counts[0], recv, counts[1], async_op)
        out = _buf(recv, "recv")
        return self._c.all_to_all_v(
            _input(send, out, "send"), [int(c) for c in send_counts], out, [int(c) for c in recv_counts], async_op
        )

    def gather(self, input, output, root, *, async_op=False):  # noqa: A002
        """Every rank's ``input`` into the root's ``output`` (``None`` elsewhere).

        At the root, an ``input`` that is its own block of ``output`` runs in place."""
        if self._st is not None or _dev.owns(input) or _dev.owns(output):
            return _staged.gather(self._stager(), input, output, root, async_op)
        out = None if output is None else _buf(output, "output")
        if out is None:
            return self._c.gather(_buf(input, "input", write=False), None, root, async_op)
        inp = _buf(input, "input", write=False)
        if self.rank == root and _block_of(inp, out, root, self.size):
            return self._c.gather_in_place(out, root, async_op)
        return self._c.gather(_input(input, out, "input", inp), out, root, async_op)

    def gather_in_place(self, buf, root, *, async_op=False):
        """Gather in place: at the root ``buf`` holds one block per rank (its own holding its
        input) and receives the others; elsewhere ``buf`` is the rank's input."""
        if self._st is not None or _dev.owns(buf):
            return _staged.gather_in_place(self._stager(), buf, root, async_op)
        return self._c.gather_in_place(_buf(buf, "buf"), root, async_op)

    def scatter(self, input, output, root, *, async_op=False):  # noqa: A002
        """Block i of the root's ``input`` (``None`` elsewhere) into rank i's ``output``.

        At the root, an ``output`` that is its own block of ``input`` runs in place (nothing
        is copied into it)."""
        if self._st is not None or _dev.owns(input) or _dev.owns(output):
            return _staged.scatter(self._stager(), input, output, root, async_op)
        out = _buf(output, "output")
        if input is None:
            return self._c.scatter(None, out, root, async_op)
        inp = _buf(input, "input", write=False)
        if self.rank == root and _block_of(out, inp, root, self.size):
            # The root's block stays where it is and nothing else of `input` is written.
            return self._c.scatter_in_place(inp, root, async_op)
        return self._c.scatter(_input(input, out, "input", inp), out, root, async_op)

    def scatter_in_place(self, buf, root, *, async_op=False):
        """Scatter in place: at the root ``buf`` holds one block per rank and is only read
        (its own block stays where it is); elsewhere ``buf`` receives the rank's block."""
        if self._st is not None or _dev.owns(buf):
            return _staged.scatter_in_place(self._stager(), buf, root, async_op)
        return self._c.scatter_in_place(_buf(buf, "buf"), root, async_op)

    def barrier(self, *, async_op=False):
        if self._st is not None:
            return _staged.barrier(self._st, async_op)
        return self._c.barrier(async_op)

    def monitored_barrier(self, timeout):
        """A barrier whose error lists every rank that did not arrive within ``timeout`` seconds."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        self._drain("monitored_barrier")
        self._c.monitored_barrier(seconds)

    def all_reduce_coalesced(self, bufs, op=ReduceOp.SUM, *, async_op=False):
        """All-reduces every buffer of ``bufs`` (one dtype) as one op."""
        if self._st is not None or any(_dev.owns(b) for b in bufs):
            return _staged.all_reduce_coalesced(self._stager(), list(bufs), op, async_op)
        return self._c.all_reduce_coalesced([_buf(b, f"bufs[{i}]") for i, b in enumerate(bufs)], _op(op), async_op)

    def all_gather_coalesced(self, inputs, outputs, *, async_op=False):
        """All-gathers each input into the matching output, as one op."""
        if self._st is not None or any(_dev.owns(b) for b in (*inputs, *outputs)):
            return _staged.all_gather_coalesced(self._stager(), list(inputs), list(outputs), async_op)
        outs = [_buf(o, f"outputs[{i}]") for i, o in enumerate(outputs)]
        ins = [_buf(x, f"inputs[{i}]", write=False) for i, x in enumerate(inputs)]
        ins = [
            _buf(_copy_of(x), f"inputs[{i}]", write=False) if any(_overlap(b, o) for o in outs) else b
            for i, (x, b) in enumerate(zip(inputs, ins))
        ]
        return self._c.all_gather_coalesced(ins, outs, async_op)

    # ------------------------------------------------------------------ point to point

    def send(self, buf, dst, tag=0):
        if self._st is not None or _dev.owns(buf):
            return _staged.send(self._stager(), buf, dst, tag)
        self._c.send(_buf(buf, "buf", write=False), dst, tag)

    def recv(self, buf, src=None, tag=0):
        """Receives into ``buf`` from ``src``, or from whichever rank first sends a message
        with ``tag`` when ``src`` is ``None``; returns the sender's rank."""
        if self._st is not None or _dev.owns(buf):
            return _staged.recv(self._stager(), buf, src, tag)
        return self._c.recv(_buf(buf, "buf"), src, tag)

    def isend(self, buf, dst, tag=0):
        """Starts sending a copy of ``buf``; pending isend/irecv start together."""
        if self._st is not None or _dev.owns(buf):
            return _staged.isend(self._stager(), buf, dst, tag)
        return self._c.isend(_buf(buf, "buf", write=False), dst, tag)

    def irecv(self, buf, src=None, tag=0):
        """Starts receiving into ``buf`` (written when the returned Work completes) from
        ``src``, or from any rank when ``src`` is ``None``: the Work's ``source_rank()`` then
        names the sender once it completed."""
        if self._st is not None or _dev.owns(buf):
            return _staged.irecv(self._stager(), buf, src, tag)
        return self._c.irecv(_buf(buf, "buf"), src, tag)

    # ------------------------------------------------------------------ groups

    def new_group(self, ranks):
        """A sub-group of the listed ranks (collective over this group); ``None`` outside it."""
        self._drain("new_group")
        c = self._c.new_group([int(r) for r in ranks])
        return None if c is None else Communicator(c)

    def group(self, ranks):
        """A sub-group over this communicator's links that only its members call; ``None`` outside."""
        self._drain("group")
        c = self._c.group([int(r) for r in ranks])
        return None if c is None else Communicator(c)

    @property
    def timeout(self):
        """The deadline of this group's ops, in seconds."""
        return self._c.timeout

    @timeout.setter
    def timeout(self, seconds):
        """Sets it for this group's ops (torch's ``new_group(timeout=...)``); the world and
        other groups keep theirs."""
        self._c.timeout = seconds

    def split(self, color, key=0):
        """Splits by ``color`` (``None`` joins no group), ordered by ``key`` then rank."""
        self._drain("split")
        c = self._c.split(None if color is None else int(color), int(key))
        return None if c is None else Communicator(c)

    # ------------------------------------------------------------------ objects

    def broadcast_object(self, obj, root):
        """The root's ``obj`` (pickled) on every rank; other ranks' ``obj`` is ignored."""
        self._drain("broadcast_object")
        data = _pickle.dumps(obj) if self.rank == root else b""
        return _pickle.loads(self._c.broadcast_bytes(data, root))

    def all_gather_object(self, obj):
        """Every rank's ``obj`` (pickled), in rank order."""
        self._drain("all_gather_object")
        return [_pickle.loads(b) for b in self._c.all_gather_bytes(_pickle.dumps(obj))]

    # ------------------------------------------------------------------ the rest

    def log_summary(self, show_straggler=False):
        """DeepSpeed's comms-logger table (``OXCOMM_COMMS_LOGGER=1`` records the ops)."""
        return self._c.log_summary(show_straggler)

    def flight_record(self):
        """This rank's last ops as JSON Lines (the flight recorder)."""
        return self._c.flight_record()

    def abort(self, reason="aborted by the application"):
        """Aborts the communicator: links close, peers notice, later ops fail at once."""
        self._c.abort(reason)

    # ------------------------------------------------------------------ surviving a failure

    def revoke(self):
        """Revokes the communicator on every member: every pending and later op of it (and of
        the world and groups sharing its links) fails at once, here and on every peer, with
        :class:`RevokedError` naming this rank. :meth:`agree` and :meth:`shrink` still work.
        Not queued behind staged device ops: it is meant to stop them."""
        self._c.revoke()

    def is_revoked(self):
        """Whether the communicator is revoked (by this rank, a peer, or a failure)."""
        return self._c.is_revoked()

    def failed_ranks(self):
        """The ranks of this group this rank knows have failed (ascending); the same on
        every survivor after :meth:`agree` or :meth:`shrink`."""
        return self._c.failed_ranks()

    def agree(self, flag=1):
        """Fault-tolerant agreement over the survivors (ULFM's ``MPIX_Comm_agree``): returns
        :class:`Agreed` ``(flag, failed)``, the bitwise AND of the survivors' ``flag``s
        (a non-negative int below 2**64) and the ranks that failed, the same on every member
        that returns. Works on a revoked communicator. Collective over the world communicator
        (``UnsupportedError`` on a group)."""
        flag = int(flag)
        if not 0 <= flag < 1 << 64:
            raise ValueError(f"flag: {flag} is not in [0, 2**64)")
        self._drain("agree")
        value, failed = self._c.agree(flag)
        return Agreed(value, failed)

    def shrink(self):
        """A new communicator of the survivors (ULFM's ``MPIX_Comm_shrink``): revokes this one,
        agrees on the failed ranks and renumbers the rest in the old order, on the links the
        job already has. Collective over the survivors of the world communicator; a rank the
        others left out (one that was frozen) gets :class:`RevokedError`."""
        self._drain("shrink")
        return Communicator(self._c.shrink())

    def grow(self, new_size):
        """This world communicator grown back to ``new_size`` ranks, e.g. after
        :meth:`shrink`: the members keep their ranks (in order) and ``new_size - size``
        newcomers take the ranks after them, each calling :meth:`join_from_store` (or
        :func:`oxcomm.join` under ``oxcomm launch --on-failure restart``). Collective over
        every member. Waits at most the communicator's ``timeout`` for the newcomers: one that
        never comes fails every member's grow with :class:`TimeoutError` naming its rank
        (``peer``). The grown communicator has links of its own; this one stays usable.

        Only a world met through a store grows (:func:`init`, :meth:`from_store`, and
        communicators shrunk or grown from one); the store must outlive the ranks that
        failed. ``new_size`` below ``size`` is :class:`InvalidArgumentError`, a group
        :class:`UnsupportedError`, both before anything is sent."""
        new_size = int(new_size)
        if new_size < 0:
            raise ValueError(f"new_size: {new_size} is negative")
        self._drain("grow")
        return Communicator(self._c.grow(new_size))


def init():
    """Joins the job the environment describes (``oxcomm launch``, torchrun with ``OXCOMM_TOKEN``, mpirun, srun)."""
    return Communicator(_native.init())


def join():
    """Joins a running job as a replacement rank: what a program started by
    ``oxcomm launch --on-failure restart`` calls instead of :func:`init` when the environment
    has ``OXCOMM_JOIN`` set (not ``0``). Waits (at most ``OXCOMM_TIMEOUT``) for the members to
    :meth:`Communicator.grow` and returns the grown communicator, this process at a rank after
    theirs. Native backend only (:class:`UnsupportedError` with ``OXCOMM_BACKEND=mpi``)."""
    return Communicator(_native.join())


def joining():
    """Whether this process was started as a replacement rank (``OXCOMM_JOIN`` set, not
    ``0``) and so calls :func:`join` rather than :func:`init`."""
    return _os.environ.get("OXCOMM_JOIN", "0") not in ("", "0")


from . import coalesced, onebit  # noqa: E402 - they use Communicator

__all__ = [
    "Agreed",
    "Communicator",
    "ReduceOp",
    "Work",
    "init",
    "join",
    "joining",
    "onebit",
    "coalesced",
    "OxcommError",
    "TimeoutError",
    "PeerGoneError",
    "MismatchError",
    "InvalidArgumentError",
    "ProtocolError",
    "AbortedError",
    "UnsupportedError",
    "RendezvousError",
    "IoError",
    "RevokedError",
    "SuspectedError",
]
