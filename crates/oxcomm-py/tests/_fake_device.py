"""A fake GPU on CPU tensors: streams whose work runs late, on threads of their own.

The CUDA code of oxcomm (``oxcomm._cuda``, the torch backend's device ops, the 1-bit path on
device tensors) sees the device only through ``oxcomm._cuda.device.Device``. :class:`FakeDevice`
is that interface on a CPU machine, built to fail where a GPU would:

- **Streams run late and concurrently.** Each stream is a queue served by its own thread, which
  sleeps a seeded random time before some of its items (a quarter, up to ``max_delay`` seconds
  each); streams are ordered only by events (:meth:`~FakeDevice.record`, :meth:`~FakeDevice.wait`),
  so two streams' work interleaves and a missing stream wait shows as a wrong answer.
- **Copies in progress are garbage.** A copy first fills its destination with :data:`MARKER`
  bytes, sleeps, then copies; pinned buffers and ``torch.empty`` start as marker bytes. A host
  read of staged memory before the event after its copy completed sees the marker, not the data.
- **Torch ops are kernels.** While the fake is installed, every torch CPU tensor is device
  memory, except *host* tensors: pinned buffers and those made by :meth:`~FakeDevice.host` (and
  what torch ops compute from host tensors only). A dispatch mode, active on every thread that
  made the device current (:meth:`~FakeDevice.use`), queues each in-place torch op on device
  tensors (``x.add_(y)``, ``x.copy_(y, non_blocking=True)``, the optimizers' ``_foreach_*_``)
  on the thread's current stream, to run later on the stream's thread, and runs any other op
  on device tensors (one that returns a new tensor or a Python value, and a blocking
  ``copy_``, which may fill a host tensor that code reads next) after host-waiting for
  everything queued on the current stream so far: the order a GPU gives, with the host running
  ahead of in-place work. ``Tensor.cpu()``, ``numpy()`` and ``tolist()`` of a device tensor
  wait for the current stream too (``cpu()`` returns a host copy).
- **The current device is per thread, 0 by default** (as CUDA's): the fake's device has index
  :attr:`~FakeDevice.index` (1 unless told), and leaving :meth:`~FakeDevice.on_stream` on a thread
  whose current device is another one records a context on that device
  (:attr:`~FakeDevice.contexts`), as ``torch.cuda.stream`` creates one on GPU 0 on a thread that
  never set its device.
- **Failures are named.** A host wait past its deadline raises oxcomm's ``TimeoutError``; an
  exception in a stream's item is kept in :attr:`~FakeDevice.errors` and raised by the next host
  wait; the seed is printed by the tests so that a failing run can be replayed
  (``OXCOMM_FAKE_SEED``).

What it does not model: the caching allocator's reuse of freed memory across streams (queued
work keeps its tensors alive), the legacy default stream's implicit synchronisation, copy
engines and SMs (any number of items run at once), CUDA-aware futures (a thread inside
:meth:`~FakeDevice.completing` runs torch ops at once, after its current stream, which is what a
CUDA-aware future's callback sees), and kernels that are not torch ops (Triton's: the Triton
kernels are checked in Triton's interpreter instead).

This module owns the fake only; ``_on_device.py`` builds the tests' view of a device on it (or
on CUDA).
"""

from __future__ import annotations

import collections
import contextlib
import random
import threading
import time
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oxcomm._cuda import device as _device

#: The byte that fills memory whose contents are not defined yet (0x5A: as f32 1.5e16, as i64
#: 6.5e18, never a value the tests use).
MARKER = 0x5A


class Key:
    """The name of a fake device (as ``torch.device("cuda", index)`` names a GPU)."""

    __slots__ = ("index",)
    type = "fake"

    def __init__(self, index):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, Key) and other.index == self.index

    def __hash__(self):
        return hash(("fake", self.index))

    def __repr__(self):
        return f"fake:{self.index}"


class Event:
    __slots__ = ("stream", "seq")

    def __init__(self, stream, seq):
        self.stream, self.seq = stream, seq

    def __repr__(self):
        return f"<event {self.stream.name}#{self.seq}>"


class Stream:
    """One stream: a queue of items run in order by its own thread, each after a random delay."""

    def __init__(self, fake, name, seed):
        self.fake, self.name = fake, name
        self.key = fake.key_
        self.items = collections.deque()
        self.pushed = 0  # items ever queued
        self.done = 0  # items ever run
        self._rng = random.Random(seed)
        self._thread = threading.Thread(target=self._serve, name=f"fake-stream-{name}", daemon=True)
        self._thread.start()

    def __repr__(self):
        return f"<fake stream {self.name}: {self.done}/{self.pushed}>"

    def _delay(self):
        if self._rng.random() >= self.fake.delayed:
            return 0.0
        return self._rng.uniform(0.0, self.fake.max_delay)

    def _serve(self):
        cv = self.fake.cv
        while True:
            with cv:
                while not self.items:
                    cv.wait()
                item = self.items[0]
            pause = self._delay()
            if pause:
                time.sleep(pause)
            try:
                self._run(item)
            except BaseException as e:  # noqa: BLE001 - kept and raised by the next host wait
                self.fake.errors.append(f"{self.name}: {item[0]}: {type(e).__name__}: {e}")
            with cv:
                self.items.popleft()
                self.done += 1
                cv.notify_all()

    def _run(self, item):
        kind = item[0]
        if kind == "wait":
            ev = item[1]
            with self.fake.cv:
                while ev.stream.done < ev.seq:
                    self.fake.cv.wait()
        elif kind == "copy":
            dst, src = item[1], item[2]
            garbage(dst)
            pause = self._delay()
            if pause:
                time.sleep(pause)
            with torch._C._AutoDispatchBelowADInplaceOrView():
                dst.copy_(src)
        else:  # "run": a kernel
            with torch._C._AutoDispatchBelowADInplaceOrView():
                item[1]()


def garbage(t):
    """Fill ``t`` with :data:`MARKER` bytes (as undefined device memory), in place."""
    if t.numel() == 0:
        return
    with torch._C._AutoDispatchBelowADInplaceOrView():
        try:
            t.view(torch.uint8).fill_(MARKER)
        except RuntimeError:
            # not viewable as bytes (a 0-d tensor, a non-contiguous view): a marker value
            t.fill_(True if t.dtype == torch.bool else 90)


# In-place ops that change a tensor's shape or strides, not its data: they run at once.
_METADATA = {
    "resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_",
    "swapaxes_", "swapdims_", "detach_", "_resize_output_", "requires_grad_", "_coalesced_",
}  # fmt: skip
# Ops that make a tensor whose contents are undefined: filled with the marker.
_UNDEFINED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def _returns_aliases(func):
    """For an op that writes only its first argument (or list) and returns it (or nothing): the
    names of the arguments its returns are, else None."""
    schema = func._schema
    args = schema.arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in args[1:]):
        return None
    sets = {}
    for a in args:
        if a.alias_info is not None:
            for s in a.alias_info.before_set:
                sets[s] = a.name
    names = []
    for r in schema.returns:
        if r.alias_info is None:
            return None
        name = next((sets[s] for s in r.alias_info.before_set if s in sets), None)
        if name is None:
            return None
        names.append(name)
    return names


_DEFERRABLE = {}


def _deferrable(func):
    """Whether ``func`` may run later, on a stream: it writes its first argument in place, reads
    no random numbers and returns only that argument."""
    got = _DEFERRABLE.get(func)
    if got is None:
        name = func._schema.name.split("::")[-1]
        ok = (
            name not in _METADATA
            and torch.Tag.nondeterministic_seeded not in func.tags
            and _returns_aliases(func) is not None
        )
        got = _DEFERRABLE[func] = ok
    return got


def _blocking_copy(func, args, kwargs):
    """A ``copy_`` without ``non_blocking=True``: it returns when the copy is done (one side may
    be memory the caller reads next from the host, as C++ code reads a host tensor it copied a
    device tensor into; on the fake device both sides are CPU tensors, so every such copy is)."""
    if func is not torch.ops.aten.copy_.default:
        return False
    return not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))


class _Of:
    """A mode of a fake device (its ``fake``)."""

    def __init__(self, fake):
        super().__init__()
        self.fake = fake


class _Kernels(_Of, TorchDispatchMode):
    """The dispatch mode that makes torch ops on device tensors kernels of the current stream."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fake = self.fake
        if fake.suspended:
            return func(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        host = [fake.is_host(t) for t in tensors]
        if not tensors:  # a factory: new device memory
            out = func(*args, **kwargs)
            if func._schema.name.split("::")[-1] in _UNDEFINED and isinstance(out, torch.Tensor):
                garbage(out)
            return out
        if all(host) or func.is_view:
            out = func(*args, **kwargs)
            if all(host):
                fake.mark_host(out)
            return out
        if not any(host) and not fake.sync_here() and _deferrable(func) and not _blocking_copy(func, args, kwargs):
            stream = fake.current_stream(fake.key_)
            fake.push(stream, ("run", lambda: func(*args, **kwargs)))
            named = dict(zip([a.name for a in func._schema.arguments], args))
            named.update(kwargs)
            outs = [named[n] for n in _returns_aliases(func)]
            return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)
        fake.flush_current()
        return func(*args, **kwargs)


# Tensor methods that read a tensor's memory from the host without a torch op (numpy's view, the
# list of values): on a device tensor, after the current stream. ``Tensor.cpu`` copies a device
# tensor to the host (as on CUDA). ``Tensor.to("cpu")`` is left alone: code that means "the CPU"
# by it (torch's object collectives on a group whose object device is the CPU) means host memory
# on a GPU machine too, and on the fake device it names the device's own type.
_HOST_READS = {torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.__array__}


class _HostReads(_Of, TorchFunctionMode):
    """The function mode that makes host reads of device tensors wait for the current stream,
    and ``.cpu()`` of one a host copy (as on CUDA, where it copies)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fake = self.fake
        if fake.suspended or func not in _HOST_READS and func is not torch.Tensor.cpu:
            return func(*args, **kwargs)
        x = args[0] if args else None
        if not fake.owns(x):
            return func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            return fake.mark_host(x.clone())
        fake.flush_current()
        return func(*args, **kwargs)


class FakeDevice(_device.Device):
    """The fake device of one process (see the module docs). ``seed`` seeds every stream's
    delays; ``index`` is the device's index; ``delayed`` the share of a stream's items that wait
    before they run, a random time up to ``max_delay`` seconds (two items of one stream, or a
    copy's start and end, are ``2 · max_delay`` apart at most)."""

    name = "fake"

    def __init__(self, seed, index=1, max_delay=1e-3, delayed=0.25):
        self.seed, self.index, self.max_delay, self.delayed = seed, index, max_delay, delayed
        self.key_ = Key(index)
        self.cv = threading.Condition()
        self.errors = []
        #: device index -> the thread that created a context there (see the module docs)
        self.contexts = {}
        self.suspended = False
        self._local = threading.local()
        self._count = 0
        self.streams = []
        self._host = {}  # storage address -> the storage (kept alive: its address stays host)
        self._host_empty = {}  # id -> weak reference, for host tensors of no storage
        self.default = self.new_stream(self.key_, "default")

    # ------------------------------------------------------------------ the Device interface

    def owns(self, x):
        return isinstance(x, torch.Tensor) and not self.suspended and x.device.type == "cpu" and not self.is_host(x)

    def key(self, x):
        return self.key_

    def current_stream(self, key):
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self, key, name=None):
        with self.cv:
            self._count += 1
            n = self._count
        s = Stream(self, name or f"s{n}", hash((self.seed, n)))
        with self.cv:
            self.streams.append(s)
        return s

    def record(self, stream):
        with self.cv:
            return Event(stream, stream.pushed)

    def wait(self, stream, event):
        self.push(stream, ("wait", event))

    def query(self, event):
        self._raise_errors()
        return event.stream.done >= event.seq

    def host_wait(self, event, deadline, what):
        with self.cv:
            while event.stream.done < event.seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _device.timed_out(what, _device.TIMEOUT_S)
                self.cv.wait(min(left, 1.0))
        self._raise_errors()

    def copy(self, dst, src, stream):
        with self.on_stream(stream):
            self.push(stream, ("copy", dst, src))

    @contextlib.contextmanager
    def on_stream(self, stream):
        local = self._local
        prev = getattr(local, "stream", None)
        local.stream = stream
        try:
            yield
        finally:
            local.stream = prev
            here = getattr(local, "index", 0)
            if here != stream.key.index:
                # torch.cuda.stream's exit restores the current device's stream: a context there
                self.contexts.setdefault(here, threading.current_thread().name)

    def pinned(self, nbytes):
        with self.host_scope():
            t = torch.empty(nbytes, dtype=torch.uint8)
            garbage(t)
        return self.mark_host(t)

    def host_empty(self, shape, dtype):
        with self.host_scope():
            t = torch.empty(shape, dtype=dtype)
            garbage(t)
        return self.mark_host(t)

    def keep(self, x, stream):
        pass

    def use(self, key):
        local = self._local
        local.index = key.index
        if getattr(local, "mode", None) is None:
            local.reads = _HostReads(self)
            local.reads.__enter__()
            local.mode = _Kernels(self)
            local.mode.__enter__()

    @contextlib.contextmanager
    def completing(self, key):
        self.use(key)
        local = self._local
        before = getattr(local, "sync", False)
        local.sync = True
        try:
            yield
        finally:
            local.sync = before

    def future(self, key):
        return torch.futures.Future()

    # ------------------------------------------------------------------ what tests use

    def push(self, stream, item):
        with self.cv:
            stream.items.append(item)
            stream.pushed += 1
            self.cv.notify_all()

    def launch(self, stream, fn):
        """Queue a kernel (any callable; torch ops in it run as plain CPU ops) on ``stream``."""
        self.push(stream, ("run", fn))

    def sleep(self, stream, seconds):
        """Queue a kernel that only takes ``seconds`` (``torch.cuda._sleep``)."""
        self.push(stream, ("run", lambda: time.sleep(seconds)))

    def flush_current(self):
        """Host-wait for everything queued so far on the calling thread's current stream."""
        stream = self.current_stream(self.key_)
        self.host_wait(self.record(stream), time.monotonic() + _device.TIMEOUT_S, "a torch op on the device")

    def synchronize(self):
        """Host-wait for every stream (``torch.cuda.synchronize``)."""
        with self.cv:
            streams = list(self.streams)
        deadline = time.monotonic() + _device.TIMEOUT_S
        for s in streams:
            self.host_wait(self.record(s), deadline, "synchronize")

    def sync_here(self):
        return getattr(self._local, "sync", False)

    @contextlib.contextmanager
    def use_stream(self, stream):
        """``torch.cuda.stream(stream)`` for a test's own code."""
        with self.on_stream(stream):
            yield

    @contextlib.contextmanager
    def host_scope(self):
        """Torch ops in the block run at once, as host ops (the fake's own bookkeeping)."""
        local = self._local
        mode = getattr(local, "mode", None)
        if mode is None:
            yield
            return
        with torch.utils._python_dispatch._disable_current_modes():
            yield

    @contextlib.contextmanager
    def suspend(self):
        """The block runs as on a machine without the device: every tensor is host memory and
        torch ops run at once (the tests' references). Waits for every stream first."""
        self.synchronize()
        self.suspended = True
        try:
            yield
        finally:
            self.suspended = False

    def host(self, t):
        """``t`` (a tensor made by the caller) as host memory."""
        return self.mark_host(t)

    def is_host(self, t):
        if t.device.type != "cpu":
            return True
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return True
        if ptr == 0:
            ref = self._host_empty.get(id(t))
            return ref is not None and ref() is t
        return ptr in self._host

    def mark_host(self, out):
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr == 0:
                    self._host_empty[id(t)] = weakref.ref(t)
                else:
                    self._host[ptr] = storage
        return out

    def _raise_errors(self):
        if self.errors:
            raise RuntimeError(f"fake device seed {self.seed}: a stream's item failed: {self.errors[0]}")
