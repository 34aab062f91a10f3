"""How a call's tensors map onto the flat buffers an oxcomm op reads and writes.

This module owns the layouts: flat views, contiguous scratch copied back after the op, tensors
that lie back to back in one storage (written in place), grouping by dtype. It knows nothing of
c10d's calls or of issuing ops.
"""

from __future__ import annotations


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



def _overlaps_earlier(tensors, k):
    """Whether ``tensors[k]`` shares memory with one of ``tensors[:k]``."""
    t = tensors[k]
    if t.numel() == 0:
        return False
    lo, hi = _span(t)
    for u in tensors[:k]:
        if u.numel() and u.device == t.device:
            a, b = _span(u)
            if a < hi and lo < b:
                return True
    return False


def _span(t):
    """[first byte, last byte + 1) of a tensor's elements in memory."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return start, start + (last + 1) * t.element_size()
