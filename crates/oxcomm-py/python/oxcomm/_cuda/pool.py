"""Pinned host buffers that staged ops reuse.

This module owns the pinned memory of one communicator's staging: a free list of page-locked
buffers, each with the event after which the device no longer reads or writes it. An op takes
buffers, and gives them back with that event when its last copy is queued; the next op that
takes one makes its first copy wait on the event (a stream wait, not a host wait). A buffer is
grown (replaced by a larger one) when an op needs more than any free buffer holds, so after the
first steps of a training loop no op allocates: the pool holds one buffer per slot of the
largest op seen (``staging.SLOTS`` for a chunked op), up to :data:`KEEP_BYTES` in all; a buffer
given back past that is dropped (an unchunked op on a large tensor, an all-gather's output, then
allocates each time). It knows nothing about ops or streams beyond carrying the release event.

Pinned memory is allocated by the device (torch's caching host allocator on CUDA, which also
keeps a dropped buffer alive until the copies queued on it are done, and then keeps its block
cached for the next pinned allocation: ``torch._C._host_emptyCache()`` gives those back).
"""

from __future__ import annotations

import os
import threading

#: Buffers are allocated in multiples of this many bytes (and at least this much), so that sizes
#: a little apart share a buffer.
GRAIN = 1 << 16
#: Byte offset alignment of the parts laid out in one buffer (a cache line; CUDA copies want 16).
ALIGN = 256
#: The most bytes of free pinned buffers one communicator keeps: ``OXCOMM_CUDA_POOL_BYTES``,
#: default 256 MiB (the three slots of a chunked op take 3 × ``OXCOMM_CUDA_CHUNK_BYTES``).
KEEP_BYTES = int(os.environ.get("OXCOMM_CUDA_POOL_BYTES", str(256 << 20)))


class Buffer:
    """One pinned buffer: ``data`` (uint8, ``capacity`` bytes) and ``released``, the event after
    which the device is done with it (``None``: nothing in flight)."""

    __slots__ = ("data", "capacity", "released")

    def __init__(self, data):
        self.data = data
        self.capacity = data.numel()
        self.released = None

    def view(self, offset, count, dtype):
        """``count`` elements of ``dtype`` from byte ``offset`` (a flat host tensor)."""
        nbytes = count * dtype.itemsize
        return self.data[offset : offset + nbytes].view(dtype)


def layout(sizes):
    """Byte offsets for parts of ``sizes`` bytes laid out back to back at :data:`ALIGN`, and
    the total."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    return offsets, at


class PinnedPool:
    """The free pinned buffers of one communicator (thread-safe)."""

    def __init__(self, device):
        self._device = device
        self._free = []
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated so far (tests check that it stops growing)

    def take(self, nbytes):
        """A buffer of at least ``nbytes`` bytes: the smallest free one that fits, else a new
        one that replaces the largest free buffer (which is dropped)."""
        with self._lock:
            fits = [b for b in self._free if b.capacity >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.capacity)
                self._free.remove(best)
                return best
            if self._free:
                self._free.remove(max(self._free, key=lambda b: b.capacity))
            self.allocated += 1
        size = max(GRAIN, (nbytes + GRAIN - 1) // GRAIN * GRAIN)
        return Buffer(self._device.pinned(size))

    def give(self, buffers, released):
        """Back to the pool; the device is done with them once ``released`` completes. Past
        :data:`KEEP_BYTES` of free buffers, the largest are dropped."""
        with self._lock:
            for b in buffers:
                b.released = released
                self._free.append(b)
            held = sum(b.capacity for b in self._free)
            while held > KEEP_BYTES and self._free:
                big = max(self._free, key=lambda b: b.capacity)
                self._free.remove(big)
                held -= big.capacity
